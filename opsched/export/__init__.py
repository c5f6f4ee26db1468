"""Writers of plans and pictures: plan JSON, Gantt timelines, torch pipelining CSV."""
