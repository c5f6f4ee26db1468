"""The plain-text table of ``opsched compare``: a row per method, with the MIP's bound, gap and search notes.

Rows are the JSON objects opsched.plan.compare builds; this module turns them
into the table printed on stdout and into the solver figures a MIP row adds
to its plan.json.
"""

from __future__ import annotations

from opsched.solving.solver import Status


def _g(x: float) -> str:
    return f"{x:.4g}"


def idle_text(idle: list[float]) -> str:
    """Idle time per device: one value when all agree, else the list (or min..max for many devices)."""
    if max(idle) - min(idle) <= 1e-9 * max(1.0, max(idle)):
        return f"{_g(idle[0])} each"
    if len(idle) <= 8:
        return " ".join(_g(x) for x in idle)
    return f"{_g(min(idle))}..{_g(max(idle))}"


def solver_note(row: dict) -> str:
    """'; lower bound 27, gap 0%, cbc 0.1 s' for a MIP row, else ''.

    With another objective than the makespan, its value comes first, and the
    bound and gap are on it:

    >>> solver_note({"objective": "zb-span", "objective_value": 30, "lower_bound": 27, "gap": 0.1})
    '; zb-span 30, lower bound 27, gap 10.0%'

    A solve that a clock stopped, or whose search crashed, says so last (its
    schedule is the best found by then):

    >>> solver_note({"lower_bound": 27, "gap": 0.1, "solver": "cbc", "solve_seconds": 120.2,
    ...              "status": "time limit reached", "cut_by": "the 120 s limit"})
    '; lower bound 27, gap 10.0%, cbc 120.2 s, time limit reached (the 120 s limit)'

    Overlapped pairs the makespan did not need, run one job after the other:

    >>> solver_note({"lower_bound": 47, "gap": 0.01, "pairs_parted": 6})
    '; lower bound 47, gap 1.0%, 6 pairs parted (they saved no time)'
    """
    if row.get("lower_bound") is None:
        return ""
    objective = row.get("objective", "makespan")
    value_text = "" if objective == "makespan" else f"; {objective} {_g(row['objective_value'])},"
    gap = row.get("gap")
    gap_text = "" if gap is None else f", gap {100 * gap:.1f}%"
    secs = row.get("solve_seconds")
    time_text = "" if secs is None else f", {row.get('solver', '')} {secs:.1f} s"
    status = row.get("status")
    status_text = f", {status}" if status in (str(Status.TIME_LIMIT), str(Status.ERROR)) else ""
    if status == str(Status.TIME_LIMIT) and row.get("cut_by"):
        status_text += f" ({row['cut_by']})"
    parted = row.get("pairs_parted") or 0
    parted_text = f", {parted} pairs parted (they saved no time)" if parted else ""
    tried = row.get("placements_tried") or []
    bound_text = f"lower bound {_g(row['lower_bound'])}"
    if len(tried) > 1:  # the bound and gap hold for the winning placement; the least over all tried is separate
        bound_text += f" on this placement ({_g(row['lower_bound_all_placements'])} over the {len(tried)} tried)"
    return f"{search_note(tried)}{value_text or ';'} {bound_text}{gap_text}{parted_text}{time_text}{status_text}"


def search_note(tried: list[dict]) -> str:
    """'; best of chain 55, v 51.5, bidirectional refused' when the MIP tried several placements, else ''.

    A placement whose bound proved it could not win before any search shows that bound:

    >>> search_note([{"placement": "chain", "objective_value": None, "lower_bound": 58.0, "error": "not solved: ..."},
    ...              {"placement": "v", "objective_value": 51.5, "lower_bound": 51.5, "error": None},
    ...              {"placement": "bidirectional", "objective_value": None, "error": "too small"}])
    '; best of chain cannot win (bound 58), v 51.5, bidirectional refused'
    """
    if len(tried) < 2:
        return ""
    return "; best of " + ", ".join(f"{t['placement']} {_tried_text(t)}" for t in tried)


def _tried_text(t: dict) -> str:
    if not t["error"]:
        return _g(t["objective_value"])
    if t["error"].startswith("not tried"):
        return "not tried"
    if t["error"].startswith("no schedule"):
        return "no schedule in time"
    if t["error"].startswith("not solved"):
        return f"cannot win (bound {_g(t['lower_bound'])})"
    return "refused"


def table(rows: list[dict], header: str) -> str:
    """The plain-text table of method x (makespan, bubble ratio, idle per device, peak activation, copies, placement)."""
    cols = ["method", "makespan", "bubble", "idle per device", "peak act", "params", "placement"]
    body = []
    for r in rows:
        if r["error"]:
            body.append([r["method"], "refused: " + r["error"]])
            continue
        body.append([
            r["method"],
            _g(r["makespan"]),
            f"{r['bubble_ratio']:.4f}",
            idle_text(r["idle"]),
            _g(r["peak_activation_bytes"]),
            f"{r['param_copies']:g}x",
            r["placement"] + (" (branches run one after another)" if r.get("linearized") else "") + solver_note(r),
        ])
    full = [b for b in body if len(b) == len(cols)]
    widths = [max([len(c)] + [len(b[i]) for b in full]) for i, c in enumerate(cols)]
    widths[0] = max([widths[0]] + [len(b[0]) for b in body])
    right = {1, 2, 4, 5}

    def line(cells):
        if len(cells) == 2:
            return f"{cells[0]:<{widths[0]}}  {cells[1]}"
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([header, line(cols)] + [line(b) for b in body])


def plan_figures(row: dict) -> dict:
    """A MIP row's solver figures for plan.json's metrics; there ``lower_bound`` and ``gap`` are on the makespan.

    >>> plan_figures({"objective": "zb-span", "objective_value": 30, "lower_bound": 27, "gap": 0.1, "solver": "cbc"})
    {'solver': 'cbc', 'objective': 'zb-span', 'objective_value': 30, 'objective_lower_bound': 27, 'objective_gap': 0.1}
    """
    figures = {k: row[k] for k in ("lower_bound", "gap", "solver", "solve_seconds") if k in row}
    if row.get("objective", "makespan") != "makespan":  # the bound is on that objective, not on the makespan
        figures = {k: v for k, v in figures.items() if k not in ("lower_bound", "gap")}
        figures.update(objective=row["objective"], objective_value=row["objective_value"],
                       objective_lower_bound=row["lower_bound"], objective_gap=row["gap"])
    return figures
