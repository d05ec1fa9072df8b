"""Pure scheduling decisions: no Ray, no ONNX Runtime, no I/O, no clock reads.

Each decision takes read-only views or frozen values and returns a frozen decision,
so the node, the router and an offline simulator share the same code.
"""

from policies.admission import Admit, Candidate, QueueLimits, QueueLoad, Refuse, decide_admission
from policies.batching import BatchParams, BatchPlan, batch_limit, plan_batch
from policies.ordering import QUEUE_ORDERS, FifoOrder, PriorityOrder, QueueOrder
from policies.preemption import PreemptionParams, should_preempt

__all__ = [
    "QUEUE_ORDERS",
    "Admit",
    "BatchParams",
    "BatchPlan",
    "Candidate",
    "FifoOrder",
    "PreemptionParams",
    "PriorityOrder",
    "QueueLimits",
    "QueueLoad",
    "QueueOrder",
    "Refuse",
    "batch_limit",
    "decide_admission",
    "plan_batch",
    "should_preempt",
]
