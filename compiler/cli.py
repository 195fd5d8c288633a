"""The ``shardprop`` command: ``shardprop launch ...`` starts a multi-process run."""
from __future__ import annotations

import sys


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: shardprop launch [--nproc N | --gpus 0,1,...] [--devices-per-proc K] [--ips h1,h2] "
              "[--port P] [--log-dir log] script.py [args...]\n\n"
              "shardprop launch --help   for details")
        return 0 if argv else 2
    if argv[0] != "launch":
        print(f"shardprop: unknown command {argv[0]!r}; the command is 'launch'", file=sys.stderr)
        return 2
    from ..runtime.launch import main as launch
    return launch(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
