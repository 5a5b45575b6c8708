"""``inflight.engine.spec_decode``: which speculative configurations an in-flight engine takes,
and the CPU ``expand_kernel`` replacement against vLLM's own Triton kernel (run by Triton's
interpreter here)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from inflight.engine.spec_decode import _expand, problems


def _config(method: str | None, *, async_scheduling: bool = False, other_vocab: bool = False) -> SimpleNamespace:
    spec = None if method is None else SimpleNamespace(method=method, use_heterogeneous_vocab=other_vocab)
    return SimpleNamespace(speculative_config=spec, scheduler_config=SimpleNamespace(async_scheduling=async_scheduling))


def test_ngram_and_draft_models_run_in_flight_and_eagle_and_mtp_are_refused_by_name() -> None:
    assert problems(_config(None), record_routing=True) == []
    for method in ("ngram", "draft_model"):
        assert problems(_config(method), record_routing=False) == []
    for method in ("eagle", "eagle3", "mtp"):
        (why,) = problems(_config(method), record_routing=False)
        assert f"speculative_config.method={method!r}" in why and "not updated in flight" in why
    (why,) = problems(_config("ngram", async_scheduling=True), record_routing=False)
    assert "async scheduling" in why
    (why,) = problems(_config("ngram"), record_routing=True)
    assert "record_routing" in why
    (why,) = problems(_config("draft_model", other_vocab=True), record_routing=False)
    assert why.startswith("speculative_config.use_heterogeneous_vocab=True: a draft of another vocabulary")


def _vllm_expand_kernel(tmp_path):
    """vLLM 0.32's ``expand_kernel``, its source (read from vLLM's file: once an engine started
    in the process, the module holds the CPU platform's stand-in instead) compiled by the real
    Triton, to run in Triton's interpreter (``TRITON_INTERPRET=1``)."""
    import ast
    import importlib.util

    from vllm.v1.sample import rejection_sampler

    text = Path(rejection_sampler.__file__).read_text()
    (node,) = [n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and n.name == "expand_kernel"]
    path = tmp_path / "vllm_expand_kernel.py"
    path.write_text("import triton\nimport triton.language as tl\n\n\n@triton.jit\n"
                    + ast.get_source_segment(text, node) + "\n")
    spec = importlib.util.spec_from_file_location("vllm_expand_kernel", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.expand_kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.int64])
def test_expand_matches_vllms_kernel_for_every_dtype(dtype, tmp_path) -> None:
    from vllm.v1.sample.rejection_sampler import MAX_SPEC_LEN

    expand_kernel = _vllm_expand_kernel(tmp_path)
    values = torch.tensor([0.7, 0.0, 1.3, 2.0]).to(dtype)
    cu = torch.tensor([3, 3, 5, 9], dtype=torch.int32)  # 3, 0, 2 and 4 tokens
    want = torch.full((9,), -1).to(dtype)
    expand_kernel[(4,)](want, values, cu, 0, 5, MAX_NUM_TOKENS=MAX_SPEC_LEN)
    got = torch.full((9,), -1).to(dtype)
    _expand(got, values, cu, 0, 5)
    assert torch.equal(got, want), (got, want)
    assert not torch.equal(want, torch.full((9,), -1).to(dtype))  # the reference wrote something


def test_vllms_cpu_expand_leaves_float_outputs_unwritten() -> None:
    """The defect ``fix_cpu_expand_kernel_vllm_0_32`` mends: vLLM 0.32's CPU implementation
    writes a float output into an int64 copy, so the caller's tensor keeps what it held."""
    from vllm.utils.cpu_triton_utils import _expand_kernel_impl

    out = torch.full((5,), -1.0)
    _expand_kernel_impl(out, torch.tensor([0.7, 1.3]), torch.tensor([3, 5]), 0, 0)
    assert torch.equal(out, torch.full((5,), -1.0))
    _expand(out, torch.tensor([0.7, 1.3]), torch.tensor([3, 5]), 0, 0)
    assert torch.equal(out, torch.tensor([0.7, 0.7, 0.7, 1.3, 1.3]))
