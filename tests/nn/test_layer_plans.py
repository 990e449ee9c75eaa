"""The layers' call plans (``overlap.nn.layers._CallPlans``): a layer's forward + backward
makes few Python calls beyond its ops, and a plan follows the layer's settings and input
signature (``_layer_plans_worker.py``, gloo)."""

from __future__ import annotations

from tests._procs import REPO, run_ranks

WORKER = REPO / "tests" / "_layer_plans_worker.py"


def test_layer_calls_within_budget() -> None:
    (p,) = run_ranks(WORKER, 1, ["counts"], timeout_s=120)
    assert p.returncode == 0 and "PASS layer_plans counts" in p.out, p


def test_plans_follow_settings() -> None:
    for p in run_ranks(WORKER, 2, ["settings"], timeout_s=120):
        assert p.returncode == 0 and f"PASS layer_plans settings world=2 rank={p.rank}" in p.out, p
