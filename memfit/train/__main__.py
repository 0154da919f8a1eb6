"""``python -m memfit.train RUN.yaml [--set KEY=VALUE ...] [--resume]``: what launchers run in each process.

Rank and world size come from torch.distributed / the launcher's environment; only rank 0 shows
progress and writes metrics, the run file and the adapter.
"""

from __future__ import annotations

import argparse
import sys

from memfit.errors import MemfitError, TrainingInterrupted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memfit.train", description=__doc__.splitlines()[0])
    parser.add_argument("run_file")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--json", action="store_true", help="print the result as JSON (rank 0)")
    args = parser.parse_args(argv)
    from memfit.train.quiet import quiet_libraries

    quiet_libraries()
    try:
        from memfit.distributed.ranks import rank_info
        from memfit.spec.run import load_run
        from memfit.train.api import train

        run = load_run(args.run_file, args.overrides)
        main_rank = rank_info()[0] == 0
        callbacks = []
        if main_rank and not args.json:
            from memfit.train.callbacks import RichProgress

            callbacks.append(RichProgress())
        try:
            result = train(run, callbacks=callbacks, resume=args.resume, overwrite=args.overwrite)
        finally:
            for cb in callbacks:
                cb.close()
    except MemfitError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, TrainingInterrupted) as err:
        print(str(err) or "interrupted", file=sys.stderr)
        return 130
    if main_rank:
        if args.json:
            from memfit.cli.output import print_json

            print_json(result.to_dict())
        else:
            from memfit.cli.train_view import print_summary

            print_summary(result)
    from memfit.distributed.ranks import finish

    finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
