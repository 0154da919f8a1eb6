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
        from memfit.distributed.faults import drill_callback

        drill = [cb for cb in [drill_callback()] if cb is not None]  # MEMFIT_FAULT_DRILL (tests, drills)
        try:
            result = train(run, callbacks=[*callbacks, *drill], resume=args.resume, overwrite=args.overwrite)
        finally:
            for cb in callbacks:
                cb.close()
    except MemfitError as err:
        print(f"error: {err}", file=sys.stderr)
        from memfit.distributed.ranks import rank_info

        if rank_info()[2] > 1:  # the peers may wait in a collective: end now, they follow
            from memfit.distributed.faults import fail_fast, where
            from memfit.distributed.watch import mark_failed

            mark_failed(f"{where()}: {err}")
            fail_fast(2)
        return 2
    except (KeyboardInterrupt, TrainingInterrupted) as err:  # the step and how to resume, said once
        from memfit.distributed.ranks import is_main_process

        if is_main_process():
            print(str(err) or "interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # one rank of several failed: say which, end now (the peers follow)
        from memfit.distributed.ranks import rank_info

        if rank_info()[2] == 1:
            raise
        from memfit.distributed.faults import fail_fast, failure_line
        from memfit.distributed.watch import mark_failed

        line = failure_line(err)
        print(f"error: {line}", file=sys.stderr)
        mark_failed(line)  # the ranks of other nodes, even one that hangs, end too (memfit.distributed.watch)
        fail_fast(1)
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
