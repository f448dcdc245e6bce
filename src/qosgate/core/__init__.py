"""The sans-I/O scheduling core: no asyncio, no sockets, no clock reads; time is passed in."""

from qosgate.core.classifier import Classification, Classifier, QosInputError, QosInputs
from qosgate.core.decisions import Decision, Dispatch, Finished, Preempt
from qosgate.core.facts import AttemptFailed
from qosgate.core.queueing import POLICY_NAMES, build_policy
from qosgate.core.replica import ReplicaSpec
from qosgate.core.request import Request, State
from qosgate.core.scheduler import Scheduler

__all__ = [
    "POLICY_NAMES",
    "AttemptFailed",
    "Classification",
    "Classifier",
    "Decision",
    "Dispatch",
    "Finished",
    "Preempt",
    "QosInputError",
    "QosInputs",
    "ReplicaSpec",
    "Request",
    "Scheduler",
    "State",
    "build_policy",
]
