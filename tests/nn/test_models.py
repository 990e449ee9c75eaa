"""``parallelize(model)`` with no plan on tiny HF transformers models built from their
configs (``_models_worker.py``): Llama, Mistral, Qwen2, Qwen3, GPT-2, a torchtitan-like
Llama (also through torchtitan's plan in torch's styles), gpt-fast- and nanoGPT-like models
at 2 ranks (vocab-parallel too), Llama alone at 4, sequence-parallel and not, against the unsharded
model; and the failures that must raise with the model left unchanged. One worker process
per rank runs every case.
"""

from __future__ import annotations

import pytest

from tests._procs import REPO, run_ranks

HF_MODULES = tuple(f"transformers.models.{m}.modeling_{m}" for m in ("llama", "mistral", "qwen2", "qwen3", "gpt2"))
"""The model files the ranks build from, imported once before they are forked (``run_ranks``)."""

pytest.importorskip("transformers", reason="the model tests build HF transformers models (the test extra)")


@pytest.mark.parametrize(("world_size", "families"), [(2, []), (4, ["llama", "--quick"])])
def test_parallelize_models_gloo(world_size: int, families: list[str]) -> None:
    procs = run_ranks(REPO / "tests" / "_models_worker.py", world_size, families, timeout_s=240,
                       preload=HF_MODULES)
    for p in procs:
        assert p.returncode == 0 and f"PASS models world={world_size} rank={p.rank}" in p.out, p
