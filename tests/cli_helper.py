"""The CLI run in-process, as the tests call it."""

from memfit.cli.app import main


def run_cli(capsys, *argv):
    """(exit code, stdout, stderr) of `memfit argv`."""
    code = 0
    try:
        main(list(argv))
    except SystemExit as exc:
        code = exc.code or 0
    out, err = capsys.readouterr()
    return code, out, err
