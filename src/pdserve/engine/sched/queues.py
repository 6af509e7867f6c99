"""The waiting and running queues and the policy that orders them.

``fcfs``: a request joins the back of the waiting queue; a preempted one resumes at the
front; the preemption victim is the most recently admitted running request.

``priority`` (``--scheduling-policy priority``): the waiting queue is kept ordered by
(priority, arrival), lower first as in vLLM, a preempted request included; the victim is
the running request with the highest (priority, arrival) among those not yet scheduled
in the step. A waiting request never preempts running ones to get in.

A request whose remote KV has landed resumes at the front under either policy.
"""

from __future__ import annotations

from collections import deque

from pdserve.engine.request import Request, RequestStatus


class Queues:
    def __init__(self, policy: str) -> None:
        self.priority = policy == "priority"
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def enqueue(self, req: Request, front: bool) -> None:
        """Into the waiting queue: fcfs at the back (``front``: at the front, where a
        preempted request resumes); priority by (priority, arrival)."""
        if not self.priority:
            if front:
                self.waiting.appendleft(req)
            else:
                self.waiting.append(req)
            return
        key = (req.priority, req.arrival_time)
        for j, other in enumerate(self.waiting):
            if key < (other.priority, other.arrival_time):
                self.waiting.insert(j, req)
                return
        self.waiting.append(req)

    def resume(self, req: Request) -> None:
        """At the waiting queue's front whatever the policy (its remote KV landed, or it
        is prefilled locally after the pull failed)."""
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    def victim(self, first: int) -> Request:
        """Take the running request to preempt among those not scheduled yet this step
        (``running[first:]``)."""
        if not self.priority:
            return self.running.pop()
        j = max(
            range(first, len(self.running)),
            key=lambda k: (self.running[k].priority, self.running[k].arrival_time),
        )
        return self.running.pop(j)

    def remove(self, req: Request) -> None:
        """Take a running or waiting request out (it finished from outside)."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)

    def drop_finished(self) -> None:
        self.running = [r for r in self.running if r.status == RequestStatus.RUNNING]
