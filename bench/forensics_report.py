"""The tables and verdicts bench_forensics.py prints from its rounds (see that script's doc).

Each part ran once per round; the rounds pair up by index (a part that failed stopped there, so only
the rounds every part finished are paired). Speed-ups and the fraction of the floor are taken within
a round, and a goal is PASS only when its worst round clears it.
"""

from __future__ import annotations

import os
import platform

from rounds import Spread, Verdict, at_least, at_most, per_round_ratios

GOAL_FLOOR_FRACTION = 0.5  # of the floor's rate, in the same round
# The same goal as a rate, from the floors measured when it was set (the figures); shown beside it.
GOAL_PAGE_EVENTS_PER_S = {"fleet": 240e6, "synth": 62e6}
GOAL_VS_BASELINE = 5.0
GOAL_RSS_BYTES = 1e9
KVTRAIL_PARTS = ("engine", "engine-seq", "question")
BASELINE_PARTS = ("naive-text", "naive-int", "window")
COMPETENT = ("naive-int", "window")  # what a competent user writes; naive-text is shown, not judged against


def _paired(runs: dict[str, list[dict]], *parts: str) -> int:
    return min((len(runs.get(p, ())) for p in parts), default=0)


def _walls(runs: dict[str, list[dict]], part: str, n: int) -> list[float]:
    return [r["wall_s"] for r in runs[part][:n]]


def _table(meta: dict, runs: dict[str, list[dict]], failed: dict[str, dict]) -> None:
    total = meta["page_events"]
    head = (
        f"{'part':<11} {'wall s min / median / max':>26} {'M page-ev/s':>12} {'peak RSS MB':>12} "
        f"{'F1 pages':>10} {'affected':>9} {'in truth':>9} {'same question':>14}"
    )
    print(head)
    print("-" * len(head))
    for part, rs in runs.items():
        if part in failed and not rs:
            print(f"{part:<11} {failed[part]['error']}")
            continue
        if not rs:
            continue
        wall = Spread.of([r["wall_s"] for r in rs])
        n = rs[0].get("page_events", total)
        last = rs[-1]
        same = last.get("same_question")
        same_text = "yes" if same else "no" if same is not None else "(prefix)" if "page_events" in last else "-"
        print(
            f"{part:<11} {wall.text():>26} {n / wall.median / 1e6:>12.1f} "
            f"{max(r['max_rss_bytes'] for r in rs) / 1e6:>12.0f} {last.get('f1_pages', '-'):>10} "
            f"{last.get('affected', '-'):>9} {last.get('affected_in_truth', '-'):>9} {same_text:>14}"
        )
    truth = len(meta["truth_affected_request_ids"])
    print(
        f"(wall s over {max((len(r) for r in runs.values()), default=0)} rounds, parts alternating; M page-ev/s "
        f"at the median; pure and sql ran once over a prefix and count its page-events. affected: responses with "
        f"F1/F5 (sql: F1; baselines: readers of a page whose last write was another request's or nobody's); "
        f"in truth: how many of them the ground truth's {truth} holds)"
    )
    for part in BASELINE_PARTS:
        done = runs.get(part)
        if done and done[-1].get("same_question") is False:
            r = done[-1]
            print(
                f"{part}: a different, easier question: {r['affected']:,} 'affected' against the true "
                f"{r['truth_affected']:,} ({r['affected_in_truth']:,} of those found); it knows no prefix-cache "
                f"hits, growth pages or transfers, so its time is not the cost of this answer"
            )


def _ratios(runs: dict[str, list[dict]], kv: str) -> dict:
    """Per-round speed-ups of ``kv`` over each baseline and its fraction of the floor's rate."""
    out: dict = {}
    for other in (*BASELINE_PARTS, "floor"):
        n = _paired(runs, kv, other)
        if not n:
            continue
        ratio = per_round_ratios(_walls(runs, other, n), _walls(runs, kv, n))
        s = Spread.of(ratio)
        out[other] = {"per_round": ratio, **s.as_dict()}
        if other == "floor":
            print(
                f"{kv} / floor rate: {s.text(fmt='.2f')} (min / median / max of {n} rounds; 1.00 = the machine's "
                f"limit for this read)"
            )
        else:
            print(f"{kv} vs {other}: {s.text(fmt='.1f')}x (min / median / max of {n} rounds); worst round {s.min:.1f}x")
    return out


def _goals(meta: dict, runs: dict[str, list[dict]], kv: str) -> list[Verdict]:
    total = meta["page_events"]
    rs = runs[kv]
    verdicts = []
    n = _paired(runs, kv, "floor")
    if n:
        verdicts.append(
            at_least(
                f">= {GOAL_FLOOR_FRACTION:.1f} of the floor's rate",
                per_round_ratios(_walls(runs, "floor", n), _walls(runs, kv, n)),
                GOAL_FLOOR_FRACTION,
            )
        )
    rate = GOAL_PAGE_EVENTS_PER_S.get(meta["params"]["source"])
    if rate:
        verdicts.append(at_least(f">= {rate / 1e6:.0f} M page-ev/s", [total / r["wall_s"] for r in rs], rate))
    verdicts.append(
        at_most(f"<= {GOAL_RSS_BYTES / 1e9:.0f} GB peak RSS", [r["max_rss_bytes"] for r in rs], GOAL_RSS_BYTES)
    )
    competent = [p for p in COMPETENT if runs.get(p)]
    n = _paired(runs, kv, *competent) if competent else 0
    if n:
        # Each round against the faster competent baseline of that round.
        best = [min(runs[p][i]["wall_s"] for p in competent) for i in range(n)]
        verdicts.append(
            at_least(
                f">= {GOAL_VS_BASELINE:.0f}x the faster of {'/'.join(competent)}",
                per_round_ratios(best, _walls(runs, kv, n)),
                GOAL_VS_BASELINE,
            )
        )
    return verdicts


def _worst_text(v: Verdict) -> str:
    if "floor" in v.goal:
        return f"worst round {v.worst:.2f}"
    if "page-ev/s" in v.goal:
        return f"worst round {v.worst / 1e6:.1f}"
    if "RSS" in v.goal:
        return f"worst round {v.worst / 1e9:.2f} GB"
    return f"worst round {v.worst:.1f}x"


def report(meta: dict, runs: dict[str, list[dict]], failed: dict[str, dict], args) -> dict:
    """Print the table, the per-round ratios and the verdicts; returns them for the JSON."""
    import duckdb
    import numba

    total = meta["page_events"]
    print(
        f"machine: {os.cpu_count()} CPUs, Python {platform.python_version()}, duckdb {duckdb.__version__}, "
        f"numba {numba.__version__}; numpy's huge-page advice "
        f"{'off' if os.environ.get('NUMPY_MADVISE_HUGEPAGE') == '0' else 'as numpy defaults'}"
    )
    print()
    _table(meta, runs, failed)
    sp = runs.get("split")
    if sp:
        read = Spread.of([r["read_s"] for r in sp])
        print(
            f"split: reading the store into batches {read.text()} s ({total / read.median / 1e6:.1f} M page-ev/s "
            f"at the median), then replaying them from memory (the row above); 'engine' overlaps the two, "
            f"'engine-seq' does them in turn"
        )
    figures: dict = {"ratios": {}, "goals": {}}
    on = runs.get("online")
    if on:
        keep_up = [r["ingest_s"] / r["replay_s"] for r in on]
        v = at_least("online replay keeps up with ingest", keep_up, 1.0)
        print(
            f"online: replay / ingest rate {Spread.of(keep_up).text(fmt='.1f')}x (min / median / max); "
            f"worst round {v.worst:.1f}x -> {v.word}"
        )
        figures["goals"]["online"] = [{"goal": v.goal, "worst": v.worst, "pass": v.passed}]
    print()
    for kv in KVTRAIL_PARTS:
        if not runs.get(kv):
            continue
        figures["ratios"][kv] = _ratios(runs, kv)
        verdicts = _goals(meta, runs, kv)
        print(
            f"goals ({kv}, worst of {len(runs[kv])} rounds): "
            + "; ".join(f"{v.goal}: {_worst_text(v)} -> {v.word}" for v in verdicts)
        )
        figures["goals"][kv] = [{"goal": v.goal, "worst": v.worst, "pass": v.passed} for v in verdicts]
        print()
    return figures
