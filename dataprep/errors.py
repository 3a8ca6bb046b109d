"""The one exception type the prep commands raise for problems the user must fix."""


class PrepError(Exception):
    """Bad input or options. The message names the file/line/sample and what to do; the CLI prints it
    without a traceback and exits with status 2."""
