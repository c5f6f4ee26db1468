"""What report.html shows of a plan: :class:`opsched.export.report_html.ReportPage` made from a
:class:`opsched.plan.plan_records.PlanResult`."""

from __future__ import annotations

from opsched.export.report_html import LayoutTried, MethodRow, ReportPage
from opsched.plan.plan_records import PlanResult


def report_page(result: PlanResult, summary: str, title: str) -> ReportPage:
    """The page of ``result``: its summary as printed, the plan and every baseline, every layout tried, and what
    each stage holds."""
    methods = (MethodRow(f"opsched ({result.source})", result.layout, result.step_time, chosen=True),
               *(MethodRow(b.method, b.layout, b.step_time) for b in result.baselines))
    layouts = tuple(LayoutTried(c.source, c.layout, c.status, c.estimate, c.makespan, c.step_time, c.bubble_ratio,
                                c.lower_bound, c.gap) for c in result.candidates)
    notes = {sid: f"{held.layers} ({held.modes_text})" for sid, held in result.contents.items()}
    return ReportPage(title=title, summary=summary, schedule=result.schedule, step_time=result.step_time,
                      methods=methods, refused=tuple(result.refused_baselines.items()), layouts=layouts, notes=notes)
