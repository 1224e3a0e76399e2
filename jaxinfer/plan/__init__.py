"""``jaxinfer.plan``: a performance model of DeepSeek-style deployments (pure Python: no JAX needed).

``predict`` (predict.py) gives one deployment's step, throughput, bound and memory per GPU; the hardware presets
and TOML files are hardware.py's, the one calibration from DeepSeek's published kernel figures calibration.py's,
the model's arithmetic shapes.py's (DeepSeek-V4's, with its compressed sparse attention, v4.py's), the
dual-microbatch overlap stage by stage overlap.py's. docs/plan.md compares
predictions with published capacity and production figures.
"""

from jaxinfer.plan.calibration import DEFAULT as CALIBRATION, Calibration, calibrate
from jaxinfer.plan.hardware import PRESETS as HARDWARE, Hardware, hardware
from jaxinfer.plan.predict import predict
from jaxinfer.plan.shapes import Shapes, dispatch_payload_bytes
from jaxinfer.plan.v4 import V4_FLASH, V4Config, V4Shapes

__all__ = ["CALIBRATION", "Calibration", "HARDWARE", "Hardware", "Shapes", "V4Config", "V4Shapes", "V4_FLASH",
           "calibrate", "dispatch_payload_bytes", "hardware", "predict"]
