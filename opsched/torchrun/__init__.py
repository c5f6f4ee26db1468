"""Run opsched plans on PyTorch's pipeline runtime, on CPU processes.

* :mod:`opsched.torchrun.model`: a tiny MoE transformer split into a plan's stages;
* :mod:`opsched.torchrun.launch`: one gloo process per pipeline rank (one
  thread each) running a schedule (an exported CSV or a torch built-in), with
  per-stage F/I/W timers, step timings, and the single-process reference check;
* :mod:`opsched.torchrun.calibrate`: measured times -> an opsched StageGraph;
* :mod:`opsched.torchrun.dag_runtime`: a plan whose stage graph branches (which torch's pipelining cannot run)
  on opsched's own executor, torch.distributed point-to-point transfers along the edges; its models in
  :mod:`opsched.torchrun.dag_models` (CLIP, a stand-in) and :mod:`opsched.torchrun.mmt` (GraphPipe's MMT).

torch is an optional extra (``pip install "opsched[torch]"``); nothing here is
imported by the rest of opsched.
"""
