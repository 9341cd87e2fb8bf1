"""Which jobs get the wall, from the manifest and the operator's settings (plan time)."""

from __future__ import annotations

from pathlib import Path

import pytest

from metnos_exec.errors import BadConfig
from metnos_exec.manifest import ExecutorRegistry
from metnos_exec.plan import plan_invocation
from metnos_exec.policy import Policy
from metnos_exec.sandbox.bwrap import BwrapSandbox

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "executors"
FETCH = ExecutorRegistry.load(EXAMPLES)["fetch_url"]
ARGS = {"url": "https://www.example.com/"}


def test_network_hints_get_the_wall(tmp_path: Path) -> None:
    job = plan_invocation(FETCH, ARGS, home=str(tmp_path), policy=Policy()).job
    assert job.network and job.egress is not None
    assert job.egress.summary() == "example.com:443, *.example.com:443, docs.python.org:443"
    assert job.egress.limits.connections == 32
    report = BwrapSandbox(bwrap="bwrap").containment(job)
    assert report.network.state == "kept"
    assert "egress limited to example.com:443, *.example.com:443" in report.network.reason


def test_the_operator_asks_for_the_host_network(tmp_path: Path) -> None:
    policy = Policy.from_env({"METNOS_HOST_NETWORK": "1"})
    job = plan_invocation(FETCH, ARGS, home=str(tmp_path), policy=policy).job
    assert job.network and job.egress is None
    assert BwrapSandbox(bwrap="bwrap").containment(job).network.state == "not_kept"
    full = plan_invocation(FETCH, ARGS, home=str(tmp_path), autonomy="full", policy=Policy()).job
    assert full.network and full.egress is None
    with pytest.raises(BadConfig, match="METNOS_HOST_NETWORK"):
        Policy.from_env({"METNOS_HOST_NETWORK": "maybe"})


def test_operator_deny_list_reaches_the_policy(tmp_path: Path) -> None:
    policy = Policy.from_env({"METNOS_EGRESS_DENY": "docs.python.org, *.example.com:443"})
    job = plan_invocation(FETCH, ARGS, home=str(tmp_path), policy=policy).job
    assert job.egress is not None
    assert [r.describe() for r in job.egress.deny] == ["docs.python.org", "*.example.com:443"]
