"""``koda dev``'s children and their prefixed output (pure: nothing is started here).

The failure modes: the compactor left out of ``make dev`` (chunks never compacted, a
lost chunk never produced again locally), two children on one port, and children's
lines arriving unlabelled or cut into pieces.
"""

from __future__ import annotations

import io

from koda_runtime import cli
from koda_runtime.cli.dev import DEV_COMPACTOR_EVERY_S, child_specs, pump

KODA = ["python", "-m", "koda_runtime.cli"]


def option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_dev_runs_the_gateway_scheduler_compactor_and_the_workers() -> None:
    specs = child_specs(KODA, {"APP_ENV": "dev"}, workers=3, base_port=9101)
    by_name = {s.name: s for s in specs}
    assert list(by_name) == [
        "gateway",
        "scheduler",
        "compactor",
        "webhooks",
        "worker-1",
        "worker-2",
        "worker-3",
    ]
    compactor = by_name["compactor"].argv
    # What ROLE=compactor runs, with its probes on a port of its own.
    assert compactor[3:6] == ["chunks", "compact", "--every"]
    assert int(option(compactor, "--every")) == DEV_COMPACTOR_EVERY_S == cli.COMPACTOR_EVERY_S
    worker_ports = [int(by_name[f"worker-{i}"].env["KODA_WORKER_PORT"]) for i in (1, 2, 3)]
    assert worker_ports == [9101, 9102, 9103]
    assert int(option(compactor, "--port")) == 9104
    assert by_name["webhooks"].argv[3:5] == ["webhooks", "dispatch"]
    assert int(option(by_name["webhooks"].argv, "--port")) == 9105
    assert {by_name[f"worker-{i}"].env["KODA_WORKER_ID"] for i in (1, 2, 3)} == {
        "dev-worker-1",
        "dev-worker-2",
        "dev-worker-3",
    }
    assert all(s.env["APP_ENV"] == "dev" and s.argv[:3] == KODA for s in specs)


def test_each_line_is_printed_whole_behind_its_childs_name() -> None:
    source = io.BytesIO(b"ts=1 msg=first\nts=2 msg=caf\xc3\xa9\r\nno newline at the end")
    sink = io.StringIO()
    pump("compactor", source, sink)
    assert sink.getvalue().splitlines() == [
        "compactor | ts=1 msg=first",
        "compactor | ts=2 msg=café",
        "compactor | no newline at the end",
    ]
    sink = io.StringIO()
    pump("worker-1", io.BytesIO(b"bad \xff byte\n"), sink)
    assert sink.getvalue() == "worker-1  | bad \ufffd byte\n"
