"""Handler plugins installed the way pip installs them: a module and its ``*.dist-info``
with ``entry_points.txt``, in a directory put on ``sys.path`` (or ``PYTHONPATH``)."""

from __future__ import annotations

from pathlib import Path

ECHO_MODULE = """
from koda_runtime.handlers import Usage


class EchoHandler:
    name = "echo"

    def __init__(self, settings):
        self.prefix = settings.worker_group + ":"

    async def stream(self, ctx):
        yield self.prefix
        for word in str(ctx.input.get("text", "")).split():
            if ctx.cancel.cancelled:
                return
            yield word.upper() + " "
        yield Usage(model="echo-1", prompt_tokens=1, completion_tokens=2)

    async def aclose(self):
        pass


def build(settings):
    return EchoHandler(settings)


def not_a_handler(settings):
    return object()
"""


def echo_output(group: str, text: str) -> str:
    """What the echo plugin streams for ``text`` in a worker of consumer group ``group``."""
    return group + ":" + "".join(w.upper() + " " for w in text.split())


def install(root: Path, dist: str, entry_points: dict[str, str], module: str = "") -> Path:
    """Write distribution ``dist`` (version 1.0) with ``koda_runtime.handlers`` entry points
    (name -> ``module:attr``) and, if given, the module ``koda_echo_plugin`` into
    ``root``; return ``root`` (the directory to put on the path)."""
    root.mkdir(parents=True, exist_ok=True)
    if module:
        (root / "koda_echo_plugin.py").write_text(module)
    info = root / f"{dist}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    lines = "".join(f"{name} = {target}\n" for name, target in entry_points.items())
    (info / "entry_points.txt").write_text(f"[koda_runtime.handlers]\n{lines}")
    return root
