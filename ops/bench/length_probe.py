"""Would a probe on the serving model's hidden state (TRAIL-style) predict output lengths better than the
job's own history? Measured offline on a length.py report, before building one into the engine.

The report (``ops/bench/length.py --json``) holds the job's prompts and every request's real length (greedy:
the same in every mode). This script takes the requests in the order they finished in ``--mode`` and, for each,
predicts its length from the requests finished before it, three ways:

- ``history``: the engine's own predictor (engine/core/length_predictor.py, the report's length config), fed
  the earlier requests' lengths, asked for a fresh request's median: what admission would see;
- ``probe``: ridge regression of log length on the hidden state of the prompt's last token (``--layer``,
  SmolLM2's last by default), standardised, trained on the earlier requests (TRAIL trains a small head on the
  serving model's embedding; a ridge head is the cheapest such head and needs no tuning loop per step);
- ``probe until known``: the probe while the request's template has fewer than ``min_samples`` finished rows
  (the cold start, where the history answers from the job's other templates), the history after.

Printed: the median |log predicted - log actual| over finishing order windows (the first 20, 20..100,
100..200, all), as length.py reports its own error, and per kind. The probe's cost (one forward of the prompt
is already done by prefill; the head is a dot product) is not what is measured here: its accuracy is.

    python ops/bench/length_probe.py --json out/length.json
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parents[1]))

from ops.bench.common import print_table

WINDOWS = ((0, 20), (20, 100), (100, 200), (0, 200))


def hidden_states(model_name: str, prompts: list[list[int]], layer: int, pool: str) -> Any:
    """The ``layer`` hidden state of each prompt's last token, or their mean over the prompt (``pool``), float64,
    one row per prompt."""
    import torch

    from tokenmill.engine.model.model_loader import load_model

    loaded = load_model(model_name, device="cpu", dtype="float32", attn_implementation="sdpa")
    rows = []
    with torch.inference_mode():
        for prompt in prompts:
            out = loaded.model(torch.tensor([prompt]), output_hidden_states=True)
            states = out.hidden_states[layer][0]
            rows.append((states[-1] if pool == "last" else states.mean(0)).double())
    return torch.stack(rows)


def ridge_predict(features: Any, targets: list[float], query: Any, penalty: float) -> float:
    """Ridge regression fitted on ``features`` (n x d) -> ``targets``, evaluated at ``query`` (d): in the dual
    form, (K + penalty I)^-1 y, since n (requests finished so far) is far below d (the hidden size)."""
    import torch

    mean = features.mean(0)
    scale = features.std(0, unbiased=False).clamp_min(1e-6)
    x = (features - mean) / scale
    q = (query - mean) / scale
    y = torch.tensor(targets, dtype=torch.float64)
    offset = y.mean()
    gram = x @ x.T / x.shape[1]
    alpha = torch.linalg.solve(gram + penalty * torch.eye(len(targets), dtype=torch.float64), y - offset)
    return float(offset + (x @ q / x.shape[1]) @ alpha)


def history_predictions(report: dict[str, Any], order: list[str], lengths: dict[str, int],
                        prompts: dict[str, list[int]], config: dict[str, Any]) -> list[float]:
    """The engine predictor's median for each request from the ones finished before it."""
    from tokenmill.engine.config import LengthConfig
    from tokenmill.engine.core.length_predictor import LengthPredictor
    from tokenmill.engine.core.length_state import LengthState
    from tokenmill.engine.core.request import Request
    from tokenmill.protocol.sampling import SamplingParams

    predictor = LengthPredictor(LengthConfig(**{k: v for k, v in config.items() if k in LengthConfig.model_fields}))
    max_tokens = report["args"]["max_tokens"]
    group = report["args"].get("length_group") or None
    medians = []
    for rid in order:
        request = Request(request_id=rid, prompt_token_ids=prompts[rid],
                          sampling_params=SamplingParams(max_tokens=max_tokens), arrival_time_s=0.0,
                          length_state=LengthState(group))
        medians.append(predictor.estimate(request).median_total)
        request.output_token_ids = [1] * lengths[rid]
        predictor.observe(request)
    return medians


def template_of(text: str) -> str:
    """The length.py template a job's text was made from."""
    from ops.bench.length import TEMPLATES

    for templates in TEMPLATES.values():
        for template in templates:
            if text.startswith(template.split("{topic}")[0]) and text.endswith(template.split("{topic}")[1]):
                return template
    return text


def median_error(predicted: list[float], actual: list[int], start: int, end: int) -> float:
    pairs = list(zip(predicted, actual))[start:end]
    return statistics.median(abs(math.log(max(1.0, p)) - math.log(max(1, a))) for p, a in pairs) if pairs else math.nan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True, help="a report of ops/bench/length.py --json")
    parser.add_argument("--mode", default="on-fcfs", help="whose finishing order (and length config) to replay")
    parser.add_argument("--model", default=None, help="default: the report's model")
    parser.add_argument("--layer", type=int, default=-1, help="hidden state index (0: the embeddings; -1: the last)")
    parser.add_argument("--pool", choices=("last", "mean"), default="last",
                        help="the last prompt token's state, or the mean over the prompt (with --layer 0: the mean "
                             "token embedding, known before any forward, i.e. at admission)")
    parser.add_argument("--penalties", default="0.1,1,10", help="ridge penalties to report (comma list)")
    parser.add_argument("--min-probe-samples", type=int, default=5,
                        help="finished requests the probe needs before it answers (before: max_tokens)")
    args = parser.parse_args()

    import json

    report = json.loads(Path(args.json).read_text())
    results = report["results"]
    mode = args.mode if args.mode in results else next(iter(results))
    jobs = {f"{j['kind']}-{j['index']}": j for j in report["workload"]["jobs"]}
    lengths = {rid: r["length"] for rid, r in results[mode]["requests"].items()}
    order = results[mode]["finish_order"]
    prompts = {rid: jobs[rid]["prompt_token_ids"] for rid in order}
    actual = [lengths[rid] for rid in order]
    max_tokens = report["args"]["max_tokens"]

    print(f"{len(order)} requests in {mode}'s finishing order; hidden states of layer {args.layer} ({args.pool}) "
          f"of {args.model or report['args']['model']} ...", flush=True)
    features = hidden_states(args.model or report["args"]["model"], [prompts[rid] for rid in order], args.layer,
                             args.pool)
    history = history_predictions(report, order, lengths, prompts, results[mode]["length_config"])
    # NOTE: whether the request's template had min_samples finished rows before it (the template read from the
    # job's text: an oracle of what the history's prompt-prefix keys approximate)
    min_samples = results[mode]["length_config"].get("min_samples", 5)
    templates = [template_of(jobs[rid]["text"]) for rid in order]
    known = [templates[:index].count(template) >= min_samples for index, template in enumerate(templates)]

    methods: dict[str, list[float]] = {"max_tokens": [float(max_tokens)] * len(order), "history": history}
    for penalty in (float(p) for p in args.penalties.split(",")):
        probe = []
        for index in range(len(order)):
            if index < args.min_probe_samples:
                probe.append(float(max_tokens))
                continue
            log_length = ridge_predict(features[:index], [math.log(max(1, a)) for a in actual[:index]],
                                       features[index], penalty)
            probe.append(min(float(max_tokens), max(1.0, math.exp(log_length))))
        methods[f"probe (ridge {penalty:g})"] = probe
        methods[f"probe {penalty:g} until known"] = [h if k else p for h, p, k in zip(history, probe, known)]

    rows = [[name, *(f"{median_error(p, actual, s, e):.2f}" for s, e in WINDOWS)] for name, p in methods.items()]
    print_table("median |log predicted - log actual|, by finishing order",
                ["predictor", *(f"{s}..{e}" for s, e in WINDOWS)], rows)
    kinds = sorted({jobs[rid]["kind"] for rid in order})
    rows = []
    for name, predicted in methods.items():
        cells = []
        for kind in kinds:
            pairs = [(p, a) for p, a, rid in zip(predicted, actual, order) if jobs[rid]["kind"] == kind]
            cells.append(f"{median_error([p for p, _ in pairs], [a for _, a in pairs], 0, len(pairs)):.2f}")
        rows.append([name, *cells])
    print_table("per kind, all requests", ["predictor", *kinds], rows)
    print(f"\nrequests whose template had {min_samples} finished rows before them: {sum(known)} of {len(known)}")


if __name__ == "__main__":
    main()
