"""Pure scheduling decisions: no Ray, no ONNX Runtime, no I/O, no clock reads.

Each decision takes read-only views or frozen values and returns a frozen decision,
so the node, the router and an offline simulator share the same code.
"""

from policies.admission import Admit, Candidate, QueueLimits, QueueLoad, Refuse, decide_admission
from policies.batching import BatchParams, BatchPlan, batch_limit, call_cost, plan_batch
from policies.ordering import QUEUE_ORDERS, FifoOrder, PriorityOrder, QueueOrder
from policies.preemption import PreemptionParams, should_preempt
from policies.starvation import ClassBound, StarvationParams, promote
from policies.views import ArrivalView

__all__ = [
    "QUEUE_ORDERS",
    "Admit",
    "ArrivalView",
    "BatchParams",
    "BatchPlan",
    "Candidate",
    "ClassBound",
    "FifoOrder",
    "PreemptionParams",
    "PriorityOrder",
    "QueueLimits",
    "QueueLoad",
    "QueueOrder",
    "Refuse",
    "StarvationParams",
    "batch_limit",
    "call_cost",
    "decide_admission",
    "plan_batch",
    "promote",
    "should_preempt",
]
