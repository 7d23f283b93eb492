"""Errors a user can act on. Each names the problem; none is raised across a process boundary
(there, errors travel as data in the pydantic messages)."""


class SharetuneError(Exception):
    """Base of every error this project raises on purpose."""


class ModelError(SharetuneError):
    """The model cannot be taken in: corrupt file, unsupported operator, no tunable operator."""


class ShareError(SharetuneError, ValueError):
    """A GPU/CPU share outside 1..100 %, or no lane serves it."""


class TargetError(SharetuneError, ValueError):
    """A target that TVM does not know or this service cannot tune for."""


class MessageError(SharetuneError, ValueError):
    """A message on a queue that is not valid JSON for its contract."""


class StoreError(SharetuneError):
    """Redis (the store every part shares) cannot be reached at the URL given."""


class StoreFullError(StoreError):
    """Redis reached its maxmemory (it never evicts: it is the only store); nothing was written."""


class SpecError(SharetuneError, ValueError):
    """A job's number (trials, trials per round, clients, ...) outside its range."""


class JobError(SharetuneError):
    """A job failed; the message says where and why."""


class LaneError(SharetuneError):
    """A lane cannot run as asked on this host: MPS missing for a partial GPU share, or its control
    daemon will not start or stop."""


class JobCancelled(SharetuneError):
    """A user cancelled the job; raised inside the tuner to leave the search between rounds."""


class ExposureError(SharetuneError):
    """A service would be reachable from other hosts without authentication."""
