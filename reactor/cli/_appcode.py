"""An error of the app file's own code (its import, its ``build``): the app's frames and one line naming
its file and line, not reactor's traceback; and error messages cut to a bounded length."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

_MESSAGE_CHARS = 2000


def _bounded(msg: str) -> str:
    """An error message cut to ~2,000 characters (a library's message may quote a value given on the
    command line whole: an env name of 3,000 characters came back twice)."""
    if len(msg) <= _MESSAGE_CHARS:
        return msg
    return f"{msg[:_MESSAGE_CHARS - 300]} ... [{len(msg) - _MESSAGE_CHARS + 100} characters cut] ... {msg[-200:]}"


class _AppCodeError(Exception):
    """The app's own code failed while it was imported or built: ``text`` is what to print."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text


@contextlib.contextmanager
def _app_code(app: str) -> Iterator[None]:
    """Around importing and building the app (not its run: a reaction's error is the run's, as under
    every placement): an error of the app's own code becomes :class:`_AppCodeError` (:func:`_app_error`)."""
    try:
        yield
    except Exception as e:
        told = _app_error(e, app)
        if told is None:
            raise
        raise _AppCodeError(told) from e


def _app_error(e: BaseException, app: str | None) -> str | None:
    """What to print for an error raised by the app file's own code (a syntax error, an import it lacks,
    a bug in its ``build``), or None for any other (reactor's own errors name what was wrong in one
    line, and are printed so; an error of reactor itself keeps its whole traceback).

    Printed: the traceback from the app's first frame on (the frames of reactor's command and launcher
    above it say nothing about the user's code), then ``reactor: APP line N, in FUNC: TYPE: message``.
    An error raised in reactor's own code, called from the app (a ``GraphError`` naming the app line,
    a config value refused, or a bug of reactor's), is reactor's: None (its one line, or its whole
    traceback). Only the app's import and build come here (:func:`_app_code`): an error in a
    reaction is the run's, reported alike under every placement."""
    import traceback

    if not app or isinstance(e, BrokenPipeError):  # (the output's reader left: main's quiet end)
        return None
    try:
        path = Path(app).resolve()
    except (OSError, RuntimeError):
        return None
    if isinstance(e, SyntaxError) and e.filename and Path(e.filename).resolve() == path:
        shown = "".join(traceback.format_exception_only(type(e), e)).rstrip()
        return f"{shown}\nreactor: {app} line {e.lineno}: {type(e).__name__}: {_bounded(str(e.msg))}"
    frames = traceback.extract_tb(e.__traceback__)
    mine = [i for i, f in enumerate(frames) if Path(f.filename).resolve() == path]  # (the app's frames)
    if not mine or Path(__file__).resolve().parents[1] in Path(frames[-1].filename).resolve().parents:
        return None  # (not through the app; or raised in reactor's code, called from the app: its checks'
        # message says what, or a bug's whole traceback shows where)
    at = frames[mine[-1]]
    shown = "".join(traceback.format_list(frames[mine[0]:])) + "".join(traceback.format_exception_only(type(e), e))
    message = (str(e).splitlines() or [""])[0]
    return (f"Traceback (the app's frames):\n{shown.rstrip()}\nreactor: {app} line {at.lineno}, in {at.name}: "
            f"{type(e).__name__}{': ' + _bounded(message) if message else ''}")


def check_given_file(what: str, path: str | Path) -> None:
    """A file named on the command line (``what``: "app file", "hosts file", "--with file") is one.

    Raises:
        IsADirectoryError: it is a directory (of a --with, said as such: it said "no --with file at 'lib'" of a
            folder that is there).
        FileNotFoundError: there is nothing there.
    """
    if Path(path).is_dir():
        raise IsADirectoryError(f"{what} {str(path)!r} is a directory" + (
            ": --with ships single files (give each its own --with)" if what == "--with file" else ""))
    if not Path(path).is_file():
        raise FileNotFoundError(f"no {what} at {str(path)!r}")
