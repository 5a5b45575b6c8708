"""N-gram speculation on a copy-heavy workload: tokens/s with and without it, in-flight commits vs native pause.

    python -m inflight.bench.spec [--model smollm2|DIR|tiny] [--batch 1 4 32] [--every 16] [--spec-tokens 3]
                                  [--steps 384] [--rounds 4] [--episodes 3] [--max-tokens 256] [--results PATH|'']

**Workload** (``copy_prompt``): each prompt holds a transcript of the calculator task
(``inflight.trainer.envs.calculator``, text format: per episode the problem, the ``calc:`` call,
the tool's value and the ``answer:`` line; ``--episodes`` of them), then "The same transcript,
copied exactly:" and the transcript's first line. The completion it asks for is the rest of the
transcript, a verbatim copy of the prompt: n-gram prompt lookup (vLLM's proposer: the longest
suffix of 1..3 tokens found earlier in the prompt and output, the K tokens after its first
occurrence proposed) hits wherever the model copies, and misses where the episodes differ (the
numbers after the shared template text). ``copy_ceiling`` runs that proposer on the exact copy:
the tokens per request-step and acceptance speculation reaches if the model copies verbatim
(SmolLM2-135M-Instruct, greedy, copies the transcript nearly token for token, then goes on
repeating). 64 prompts, request n decoding prompt n mod 64 with 16..``--max-tokens`` new tokens
(ignore_eos); each ``--batch`` size B in turn: B requests in flight, refilled as they finish.
Sampling: greedy (``--temperature 0``, the default) in every mode on both engines, so the two
engines decode the same tokens (greedy speculation is lossless, up to float rounding).

**Engines**: speculation is fixed when an engine starts, so two engines run one after the other,
each on the same prompts: ``plain``, then ``ngram`` (``speculative_config`` n-gram,
``--spec-tokens`` K, prompt lookup 1..3), both with ``async_scheduling=False`` (speculation on
an in-flight engine needs it: ``inflight.engine.spec_decode``) and prefix caching off (every
chunk replays the same prompts: a cache would serve none's chunks what the commits invalidate in
the others). Each engine holds max(``--batch``) sequences and runs every batch size in turn,
each after 48 warm-up steps at that size (the first steps at a new batch shape are slow).

**Modes** (``inflight.bench.inflight``'s ``Bench``), interleaved in ``--rounds`` rounds per engine
and batch size, ``--steps`` // ``--rounds`` engine steps a chunk: ``none`` (no updates),
``inflight`` (a push due every ``--every`` engine steps, skipped while the previous one stages;
a chunk whose last push is still staging runs on until it lands), ``none@inflight`` (none over
in-flight's steps, where in-flight ran past its chunk: then the ceiling of inflight and native),
``native`` (pause(keep) + update + resume, at in-flight's achieved cadence: every ``--every``
steps where in-flight kept up, else as many updates as it landed over as many steps). The
cadence counts engine steps on both engines: a speculative step emits up to K+1 tokens a
request, so there an update covers more tokens. Tokens/s counts every step's wall time, prefills
included: each chunk starts by prefilling B prompts, and a faster engine finishes and admits
more requests per chunk (as a rollout would), so prefill dilutes the ratios towards 1.

Columns: ``updates``, ``skipped`` (due pushes not sent: the previous one still staging),
``steps_per_update`` (the achieved cadence), ``tok_s`` (generated tokens / wall: for ngram the
accepted drafts and the token each request-step samples), ``rounds`` (per-chunk tok_s: median
[min..max] over rounds), ``vs_none`` and ``lost_ms_per_update`` (against the row's ceiling, none
or none@inflight: decode time lost per update, ``inflight_report.compare``), ``step_ms`` (median
step without an update), ``accept`` and ``tok_per_step`` (accepted / drafted drafts, tokens per
request-step, prefill steps included: the engine's ``SpecDecodeMeter``, ``EngineState.spec_decode``,
read before and after each chunk; None on the plain engine). Then the ratios, round by
round (round k of one against round k of the other), median [min..max]: ngram / plain tok_s per
batch and mode, inflight / native tok_s per batch and engine; and per batch size whether
speculation wins or loses (every round above 1, below 1, else even). ``none`` compares chunks of
the same steps; where in-flight ran past its chunks, its and native's chunks hold as many steps
as its pushes took on that engine, so ngram / plain for them also weighs unequal chunks.

On CPU a decode step at batch 1 is bound by reading the weights, so verifying K+1 tokens costs
about one step and accepted drafts come nearly free; at batch 32 the step is compute-bound and
each request's K drafts multiply the work, rejected ones wasted: the ratios say where the
crossing lies here. vLLM warns that speculation on CPU loses speed without
Intel OpenMP preloaded: ``LD_PRELOAD=.venv/lib/libiomp5.so`` runs both engines with it (the JSON
records ``ld_preload``). Prints the tables and one JSON line, appended to ``--results``
(``bench/results/spec.jsonl``; '' for none); the load average at start and end.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import tempfile
from pathlib import Path
from typing import Any

from inflight.bench.inflight_report import compare
from inflight.bench.paired import RequestStream
from inflight.bench.run_record import add_results_option, append_result, run_record
from inflight.trainer.envs.calculator import Calculator

ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1"}
NGRAM = {"method": "ngram", "prompt_lookup_max": 3, "prompt_lookup_min": 1}
HEADER = "Below is the transcript of a calculator session.\n\n"
AGAIN = "\nThe same transcript, copied exactly:\n\n"
POOL = 64  # distinct prompts; request n decodes prompt n % POOL
MODES = ("none", "inflight", "none@inflight", "native")
COMPARED = ("none", "inflight", "native")  # the modes ngram / plain is reported for


# ---------------------------------------------------------------------------------------------
# The workload: calculator transcripts, the completion a copy of the prompt

def transcript(seed: int, n: int, episodes: int) -> list[str]:
    """Prompt ``n``'s transcript: ``episodes`` worked episodes of the calculator task (3-digit
    operands, + - *), four lines each: the problem, the call, the tool's value, the answer."""
    calc = Calculator(digits=3, ops=("+", "-", "*"), examples=0)
    rng = random.Random(f"{seed}/{n}")
    lines = []
    for _ in range(episodes):
        p = calc.sample(rng)
        expr = p.meta["expr"]
        lines += [f"User: {p.text}", f"Assistant: calc: {expr}", f"Tool: {calc.calculate(expr)}",
                  f"Assistant: answer: {p.answer}"]
    return lines


def copy_prompt(seed: int, n: int, episodes: int) -> tuple[str, str]:
    """Prompt ``n`` and the completion that copies it: the transcript, then the request to copy
    it with its first line; the completion is the rest of the transcript, verbatim."""
    lines = transcript(seed, n, episodes)
    return HEADER + "\n".join(lines) + "\n" + AGAIN + lines[0] + "\n", "\n".join(lines[1:]) + "\n"


def ngram_draft(context: list[int], k: int, n_min: int = 1, n_max: int = 3) -> list[int]:
    """vLLM's own n-gram proposal for ``context`` (``NgramProposer``'s search): the longest
    suffix of ``n_max``..``n_min`` tokens that occurs earlier (its first occurrence), and up to
    ``k`` tokens after it ([] if none)."""
    import numpy as np
    from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens as propose

    return propose(np.asarray(context, dtype=np.int64), n_min, n_max, len(context) + k, k).tolist()


def copy_ceiling(prompt: list[int], completion: list[int], k: int) -> dict[str, int]:
    """Speculation's counts if the model emitted ``completion`` exactly: the prefill step emits
    its first token undrafted; each later step verifies ``ngram_draft``'s proposal on prompt
    and output so far, accepts its prefix that matches, and emits those and one token more
    (the last step only what the completion has left). As ``SpecDecodeMeter`` counts them."""
    steps, pos, drafted, accepted = 1, 1, 0, 0
    while pos < len(completion):
        draft = ngram_draft(prompt + completion[:pos], k)
        match = 0
        while match < len(draft) and pos + match < len(completion) and draft[match] == completion[pos + match]:
            match += 1
        emitted = min(match + 1, len(completion) - pos)
        steps, pos, drafted, accepted = steps + 1, pos + emitted, drafted + len(draft), accepted + emitted - 1
    return {"steps": steps, "emitted": len(completion), "drafted": drafted, "accepted": accepted}


class CopyStream(RequestStream):
    """``inflight.bench.paired``'s request stream on the copy workload: request n decodes
    ``prompts[n % len(prompts)]``, 16..``max_tokens`` new tokens (drawn as paired draws them),
    at ``temperature`` (0: greedy)."""

    def __init__(self, engine: Any, mode: str, seed: int, concurrency: int, *, prompts: list[list[int]],
                 max_tokens: int, temperature: float) -> None:
        super().__init__(engine, mode, seed, concurrency)
        self.prompts, self.max_tokens, self.temperature = prompts, max_tokens, temperature

    def refill(self) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        while len(self.active) < self.concurrency:
            rid, prompt = f"{self.mode}-{self.requests}", self.prompts[self.requests % len(self.prompts)]
            self.requests += 1
            params = SamplingParams(max_tokens=self.rng.randint(16, self.max_tokens), ignore_eos=True,
                                    temperature=self.temperature, output_kind=RequestOutputKind.DELTA,
                                    seed=self.requests)
            self.engine.add_request(rid, {"prompt_token_ids": prompt}, params)
            self.active.add(rid)


# ---------------------------------------------------------------------------------------------
# The arithmetic of the report

SpecCounts = dict[int, tuple[int, int, int, int]]
"""Per live version: (request-steps, emitted, drafted, accepted), as ``VersionSpecStats`` holds them."""


def spec_delta(before: SpecCounts, after: SpecCounts) -> dict[str, int]:
    """What a chunk added to the engine's speculation counts, summed over versions. A version
    absent before the chunk counts whole (the meter keeps the newest 64 versions: a chunk
    committing fewer loses none)."""
    totals = [sum(a[i] - before.get(v, (0, 0, 0, 0))[i] for v, a in after.items()) for i in range(4)]
    return dict(zip(("steps", "emitted", "drafted", "accepted"), totals))


def spec_summary(counts: list[dict[str, int]]) -> dict[str, float | None]:
    """Acceptance (accepted / drafted) and tokens per request-step over chunks' ``spec_delta``s;
    None where nothing was drafted (an engine without speculation)."""
    total = {k: sum(c[k] for c in counts) for k in ("steps", "emitted", "drafted", "accepted")}
    if not total["drafted"]:
        return {"accept": None, "tok_per_step": None}
    return {"accept": round(total["accepted"] / total["drafted"], 3),
            "tok_per_step": round(total["emitted"] / total["steps"], 3)}


def chunk_tok_s(chunk: dict) -> float:
    return chunk["tokens"] / chunk["wall_s"]


def spread(values: list[float], digits: int = 3) -> dict[str, float]:
    """Median, min and max."""
    return {"med": round(statistics.median(values), digits), "min": round(min(values), digits),
            "max": round(max(values), digits)}


def round_ratios(num: list[dict], den: list[dict]) -> list[float]:
    """tok_s of ``num``'s chunk k over ``den``'s chunk k, round by round."""
    return [chunk_tok_s(a) / chunk_tok_s(b) for a, b in zip(num, den)]


def verdict(ratio: dict[str, float]) -> str:
    """A spread of ratios: "wins" (every round above 1), "loses" (every round below 1), else "even"."""
    return "wins" if ratio["min"] > 1 else "loses" if ratio["max"] < 1 else "even"


def ratio_table(chunks: dict[tuple[str, int], dict[str, list[dict]]], batches: list[int]) -> dict[str, list[dict]]:
    """ngram / plain per (batch, mode) and inflight / native per (batch, engine), round by round."""
    spec = [{"batch": b, "mode": m, **spread(round_ratios(chunks["ngram", b][m], chunks["plain", b][m]))}
            for b in batches for m in COMPARED]
    for r in spec:
        r["speculation"] = verdict(r)
    native = [{"batch": b, "engine": e, **spread(round_ratios(chunks[e, b]["inflight"], chunks[e, b]["native"]))}
              for b in batches for e in ("plain", "ngram")]
    return {"ngram_vs_plain": spec, "inflight_vs_native": native}


# ---------------------------------------------------------------------------------------------
# The engines

def model_of(name: str, work: Path) -> Path:
    """``tiny``: a tiny random-init Llama (a smoke run; its greedy samples soon repeat); else
    ``resolve_model`` (``smollm2``, a directory)."""
    if name != "tiny":
        from inflight.trainer.models import resolve_model

        return resolve_model(name)
    from inflight.trainer.tiny_model import TinyModelConfig, build_tiny_model, default_corpus

    return build_tiny_model(work / "tiny", default_corpus(), TinyModelConfig(
        arch="llama", hidden_size=128, num_heads=2, num_kv_heads=1, tie_word_embeddings=False, seed=1))


def workload(model_dir: Path, episodes: int) -> tuple[list[list[int]], list[list[int]]]:
    """The ``POOL`` prompts and the completions that copy them, as the model's token ids."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    pairs = [copy_prompt(0, n, episodes) for n in range(POOL)]
    return ([tokenizer(p).input_ids for p, _ in pairs],
            [tokenizer(c, add_special_tokens=False).input_ids for _, c in pairs])


def measured(bench: Any, mode: str, every: int, steps: int) -> dict:
    """``Bench.run``'s chunk, with what it added to the engine's speculation counts (``spec``)."""
    def counts() -> SpecCounts:
        return {s.version: (s.steps, s.emitted, s.drafted, s.accepted) for s in bench.coordinator.status().spec_decode}

    before = counts()
    got = bench.run(mode, every, steps)
    return {**got, "spec": spec_delta(before, counts())}


def interleave(bench: Any, every: int, steps: int, rounds: int) -> dict[str, list[dict]]:
    """One batch size on one engine: per round none, inflight, (none@inflight), native at
    in-flight's achieved cadence. ``none@inflight`` is dropped where in-flight kept to its chunks."""
    chunk = steps // rounds
    chunks: dict[str, list[dict]] = {m: [] for m in MODES}
    for _ in range(rounds):
        chunks["none"].append(measured(bench, "none", every, chunk))
        got = measured(bench, "inflight", every, chunk)
        chunks["inflight"].append(got)
        same = got["steps"] == chunk
        chunks["none@inflight"].append(chunks["none"][-1] if same else measured(bench, "none", every, got["steps"]))
        landed = len(got["infos"])
        # kept up: native at --every over the chunk (as many updates); else as many as landed over as many steps
        cadence = every if (same and not got["skipped"]) or not landed else (got["steps"] - 1) // landed
        chunks["native"].append(measured(bench, "native", cadence, got["steps"]))
    if all(c["steps"] == chunk for c in chunks["inflight"]):
        chunks["none@inflight"] = []
    return chunks


def rows_of(bench: Any, engine: str, batch: int, every: int, chunks: dict[str, list[dict]]) -> list[dict]:
    rows = []
    for mode, cs in chunks.items():
        if not cs:
            continue
        r = bench.report(cs, label=mode)
        r.update(engine=engine, batch=batch, group=batch, every=every, rounds=spread([chunk_tok_s(c) for c in cs], 1),
                 **spec_summary([c["spec"] for c in cs]))
        if chunks["none@inflight"] and mode in ("inflight", "native"):
            r["ceiling"] = "none@inflight"  # compare measures them against none over in-flight's steps
        rows.append(r)
    return rows


def bench_engine(engine: str, model_dir: Path, work: Path, prompts: list[list[int]], max_len: int,
                 args: argparse.Namespace, chunks: dict) -> list[dict]:
    """One engine (``plain`` or ``ngram``), every batch size in turn; its chunks go in ``chunks``."""
    import gc

    from inflight.bench.inflight import Bench

    engine_args: dict[str, Any] = {"max_model_len": max_len, "enable_prefix_caching": False,
                                   "async_scheduling": False}
    if engine == "ngram":
        engine_args["speculative_config"] = {**NGRAM, "num_speculative_tokens": args.spec_tokens}
    stream = functools.partial(CopyStream, prompts=prompts, max_tokens=args.max_tokens, temperature=args.temperature)
    bench = Bench(str(model_dir), work, max(args.batch), seed=0, listener_nice=19, engine_args=engine_args,
                  make_stream=stream)
    rows: list[dict] = []
    try:
        for b in args.batch:
            bench.concurrency = b
            if b != max(args.batch):  # Bench warmed up at max(--batch); the first steps at a new shape are slow
                bench.run("none", 10**9, 48)
            chunks[engine, b] = interleave(bench, args.every, args.steps, args.rounds)
            rows += rows_of(bench, engine, b, args.every, chunks[engine, b])
    finally:
        bench.close()
        del bench
        gc.collect()
    return rows


# ---------------------------------------------------------------------------------------------
# The report

COLS = ["engine", "batch", "mode", "updates", "skipped", "steps_per_update", "tok_s", "rounds", "vs_none",
        "lost_ms_per_update", "step_ms", "accept", "tok_per_step"]


def show(value: Any) -> str:
    if isinstance(value, dict) and "med" in value:
        return f"{value['med']} [{value['min']}..{value['max']}]"
    return str(value)


def print_report(rows: list[dict], ratios: dict[str, list[dict]], ceiling: dict, load: list[float]) -> None:
    print(f"load average (1 min) at start / end: {load[0]} / {load[1]}")
    print(f"copy ceiling (the exact copy under n-gram lookup): {ceiling['tok_per_step']} tokens per request-step, "
          f"acceptance {ceiling['accept']}")
    print(" | ".join(COLS))
    for r in rows:
        print(" | ".join(show(r[c]) for c in COLS))
    print("\nngram / plain tok_s, round by round: median [min..max]")
    for r in ratios["ngram_vs_plain"]:
        print(f"  batch {r['batch']:>3} {r['mode']:<9} x{show(r)}  speculation {r['speculation']}")
    print("inflight / native tok_s, round by round: median [min..max]")
    for r in ratios["inflight_vs_native"]:
        print(f"  batch {r['batch']:>3} {r['engine']:<6} x{show(r)}")


def main() -> None:
    for key, value in ENV.items():
        os.environ.setdefault(key, value)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="'smollm2', a model directory, or 'tiny' (a smoke run)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 32], help="requests in flight, one after another")
    ap.add_argument("--every", type=int, default=16, help="requested update cadence, engine steps")
    ap.add_argument("--spec-tokens", type=int, default=3, help="n-gram draft tokens per step (K)")
    ap.add_argument("--steps", type=int, default=384, help="engine steps per mode, engine and batch size")
    ap.add_argument("--rounds", type=int, default=4, help="interleaved rounds the steps are split into")
    ap.add_argument("--episodes", type=int, default=3, help="calculator episodes per transcript")
    ap.add_argument("--max-tokens", type=int, default=256, help="new tokens per request: 16..this")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (both engines decode the same tokens)")
    add_results_option(ap, "spec")
    args = ap.parse_args()
    run = run_record("spec")
    load = [round(os.getloadavg()[0], 1)]
    chunks: dict[tuple[str, int], dict[str, list[dict]]] = {}
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = model_of(args.model, Path(tmp))
        prompts, copies = workload(model_dir, args.episodes)
        ceiling = spec_summary([copy_ceiling(p, c, args.spec_tokens) for p, c in zip(prompts[:8], copies[:8])])
        max_len = max(map(len, prompts)) + args.max_tokens + args.spec_tokens + 1
        for engine in ("plain", "ngram"):  # speculation is fixed when an engine starts: an engine each
            rows += bench_engine(engine, model_dir, Path(tmp), prompts, max_len, args, chunks)
    load.append(round(os.getloadavg()[0], 1))
    compare(rows)
    ratios = ratio_table(chunks, args.batch)
    print_report(rows, ratios, ceiling, load)
    line = {"bench": "spec", **run, "device": "cpu", "ld_preload": os.environ.get("LD_PRELOAD", ""),
            "model": rows[0]["model"], "batches": args.batch,
            "every": args.every, "spec_tokens": args.spec_tokens, "steps": args.steps, "rounds": args.rounds,
            "episodes": args.episodes, "max_tokens": args.max_tokens, "temperature": args.temperature,
            "prompt_tokens": spread([len(p) for p in prompts], 1), "copy_ceiling": ceiling, "load_1m": load,
            "ratios": ratios, "rows": rows}
    print(json.dumps(line))
    append_result(args.results, line)


if __name__ == "__main__":
    main()
