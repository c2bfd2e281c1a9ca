"""Imports ``transformers`` where it imports at all, for the forkserver's preload
(``workers.py``): the forkserver skips a preload that raises ImportError, but any other error (a
release that refuses the installed torch with a RuntimeError, say) would stop it, and with it
every run the tests start from it."""

try:
    import transformers  # noqa: F401
except Exception:  # whatever it raises, the runs go on without it
    pass
