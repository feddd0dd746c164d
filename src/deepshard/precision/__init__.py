"""Mixed precision: the fp16 loss scaler and the master-weight policy."""
from deepshard.precision.loss_scaler import DynamicLossScaler, LossScaler, StaticLossScaler, make_loss_scaler
from deepshard.precision.policy import PrecisionPolicy

__all__ = ["DynamicLossScaler", "LossScaler", "PrecisionPolicy", "StaticLossScaler", "make_loss_scaler"]
