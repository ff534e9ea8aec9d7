"""What of Baseten's vocabulary orchestrator cannot honour, said before anything is submitted."""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.errors import UnsupportedFeatureError
from orchestrator.spec.training import AvailabilityModel, InteractiveSessionTrigger, TrainingJob
from orchestrator.spec.weights import WeightsAuthMethod


@dataclass(frozen=True)
class SupportReport:
    errors: tuple[str, ...]  # push refuses the job
    notices: tuple[str, ...]  # accepted, but behaves differently from Baseten

    def raise_for_errors(self) -> None:
        if self.errors:
            raise UnsupportedFeatureError(
                "This job asks for something orchestrator cannot do:\n"
                + "\n".join(f"  - {e}" for e in self.errors)
            )


def check_support(job: TrainingJob) -> SupportReport:
    errors: list[str] = []
    notices: list[str] = []
    session = job.interactive_session
    if session is not None:
        if session.trigger == InteractiveSessionTrigger.ON_DEMAND:
            notices.append(
                "interactive_session (on_demand) is ignored: there are no remote editor sessions"
            )
        else:
            errors.append(
                f"interactive_session trigger {session.trigger.value} needs Baseten's remote "
                "editor sessions; remove interactive_session or use trigger=on_demand"
            )
    for i, w in enumerate(job.weights):
        if w.auth and w.auth.auth_method != WeightsAuthMethod.CUSTOM_SECRET:
            errors.append(
                f"weights[{i}].auth: {w.auth.auth_method.value} is Baseten's cloud identity; "
                "use auth_method CUSTOM_SECRET with a secret holding the credentials"
            )
    load = job.runtime.load_checkpoint_config
    if load is not None and load.enabled:
        for i, ref in enumerate(load.checkpoints):
            if ref.typ == "loops_checkpoint":
                errors.append(
                    f"runtime.load_checkpoint_config.checkpoints[{i}]: Loops checkpoints live in "
                    "Baseten Loops; use BasetenCheckpoint references to orchestrator jobs"
                )
    if job.image.docker_auth is not None:
        notices.append("image.docker_auth is recorded only: images are not pulled on this cluster")
    if job.compute.availability_model == AvailabilityModel.SPOT:
        notices.append(
            "availability_model spot is recorded only: Ray places the job like any other"
        )
    if job.priority is not None:
        notices.append("priority is recorded only: Ray starts jobs as soon as resources allow")
    return SupportReport(errors=tuple(errors), notices=tuple(notices))
