"""opsched: plan pipeline-parallel training of branch-rich models by mixed-integer programming.

Data flows one way::

    import (onnx_import) -> OpGraph (graph) -> coarsen -> BlockGraph
      -> upper (device groups, parallel modes) -> StageGraph (schedule)
      -> lower (time-indexed MIP) / baselines -> Schedule -> export
"""

from opsched.errors import OpschedError

__version__ = "0.1.0"
__all__ = ["OpschedError", "__version__"]
