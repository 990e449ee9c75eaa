"""GPU check of ``parallelize`` on an HF Llama of about 100M parameters, built from its
config (GQA, nothing downloaded), at world size 1 on CUDA in bf16: through the library's
fused ops (tile-flag path), forward and backward, sequence-parallel and not, against the
unsharded model: logits, loss and every parameter's gradient as a relative error norm
(bound 3e-2, bf16), new tokens each step. Prints ``PASS models world=1 ...``; ``SKIP``
where transformers is not installed.
"""

from __future__ import annotations

import copy
import os
import sys
import warnings

here = os.path.dirname(os.path.abspath(__file__))
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != here]  # tests/gpu leads sys.path when run
sys.path.insert(0, os.path.join(here, "..", ".."))

import torch  # noqa: E402

from overlap import dist, observe  # noqa: E402
from overlap.nn import parallelize, unshard  # noqa: E402

REL = 3e-2


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-12)).item()


def main() -> None:
    try:
        import transformers as tf
    except ImportError as e:
        print(f"SKIP models: transformers not importable ({e})", flush=True)
        return
    warnings.filterwarnings("ignore", message=".*no tile-flag path.*")
    ctx = dist.init()
    assert ctx.world_size == 1, "a world-size-1 check: run it alone"
    cfg = tf.LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
                         num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=1024)
    torch.manual_seed(0)
    ref = tf.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).train()
    n_params = sum(p.numel() for p in ref.parameters())
    assert 80e6 < n_params < 130e6, n_params
    for sp in (False, True):
        tp = parallelize(copy.deepcopy(ref), sequence_parallel=sp)
        observe.reset_report()
        for step in range(2):
            ids = torch.randint(0, cfg.vocab_size, (2, 512), generator=torch.Generator().manual_seed(step + 10 * sp))
            ids = ids.cuda()
            out_ref, out = ref(input_ids=ids, labels=ids), tp(input_ids=ids, labels=ids)
            out_ref.loss.backward()
            out.loss.backward()
            torch.cuda.synchronize()
            errs = {"logits": rel(out.logits, out_ref.logits), "loss": rel(out.loss, out_ref.loss)}
            grads = unshard(tp, grads=True)
            for name, p in ref.named_parameters():
                errs[name] = rel(grads[name], p.grad)
            worst = max(errs, key=errs.get)
            assert errs[worst] < REL, f"sp={sp} step {step}: {worst}: relative error {errs[worst]:.3g}"
            print(f"sp={sp} step {step}: loss {out.loss.item():.4f}, worst {worst} {errs[worst]:.2e}", flush=True)
            for m in (ref, tp):
                m.zero_grad(set_to_none=True)
        print(observe.report(), flush=True)
    dist.shutdown()
    print(f"PASS models world=1 params={n_params / 1e6:.0f}M", flush=True)


if __name__ == "__main__":
    main()
