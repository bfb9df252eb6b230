"""What a training step costs, measured or predicted: the collectives and FLOPs a step issues
(``comm``, ``counters``, ``flops``), the devices (``gpus``), the time model (``cost``) and its
calibration against a run (``calibrate``). The planner predicts with it; a running job's plan
check measures with it (``tracking/plan_check.py``)."""
