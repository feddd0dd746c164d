"""ZeRO strategies, one per stage, behind one interface (``deepshard.zero.strategy.ZeroStrategy``)."""
from deepshard.zero.strategy import StrategyContext, ZeroStrategy

__all__ = ["StrategyContext", "ZeroStrategy"]
