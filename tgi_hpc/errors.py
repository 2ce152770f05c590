"""One error hierarchy for the toolkit; `tgi_hpc.cli.main` turns it into exit codes."""
from __future__ import annotations


class TgiHpcError(Exception):
    """Base class: the message says what went wrong, where, and what to do."""

    exit_code = 1


class UsageError(TgiHpcError):
    """Bad command-line input (click reports its own parsing errors with code 2)."""

    exit_code = 2


class ProfileError(TgiHpcError):
    """A profile file or override is invalid; the message names file and key."""

    exit_code = 3


class TemplateError(TgiHpcError):
    """A job script could not be rendered."""

    exit_code = 4


class SlurmError(TgiHpcError):
    """sbatch/squeue/sacct/scancel failed or answered something unexpected."""

    exit_code = 5


class JobFailedError(TgiHpcError):
    """A job ended (FAILED, CANCELLED, TIMEOUT...) before it became ready."""

    exit_code = 6


class ReadinessTimeout(TgiHpcError):
    """A job is running but did not become ready in time."""

    exit_code = 7


class ModelNotFoundError(TgiHpcError):
    """The model is neither in the model store nor a local directory."""

    exit_code = 8


class DownloadError(TgiHpcError):
    """A Hub download failed (auth, missing repo, network, checksum)."""

    exit_code = 9


class ReleaseError(TgiHpcError):
    """Building or verifying an engine release failed."""

    exit_code = 10


class SSHError(TgiHpcError):
    """SSH connection, authentication or host-key problem."""

    exit_code = 11


class TunnelError(TgiHpcError):
    """The port forward could not be set up or kept alive."""

    exit_code = 12
