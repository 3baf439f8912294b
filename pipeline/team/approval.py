"""Approval gates (`run.approve_before`): before a named stage starts, the pipeline's flow run pauses with a typed
form in the Prefect UI (approve yes/no, a note) whose description holds the metrics of every stage done so far.

The flow waits in its own process (nothing is rescheduled, so approving recomputes nothing) and holds no GPU slot
while it waits: slots are taken only by a running stage. A rejection ends the run as Cancelled, its note kept in
run.json and the report.
"""

from __future__ import annotations

from collections.abc import Callable

from pydantic import Field
from prefect.input import RunInput

from gptforge.pipeline.store import RunRecord, now
from gptforge.pipeline.team.pools import Rejected

POLL_SECONDS = 3


class Approval(RunInput):
    approve: bool = Field(False, description="Start the stage (leave unticked and submit to reject it)")
    note: str = Field("", description="Why: kept in run.json and the report")


def done_so_far(record: RunRecord, step: str) -> str:
    """The form's description: what the person is asked, and the metrics of the stages already done."""
    from gptforge.pipeline.report import stage_table

    done = {s: i for s, i in record.data["stages"].items() if i.get("status") == "complete"}
    tables = "\n\n".join(f"### {s}\n\n{stage_table(s, i)}" for s, i in done.items())
    return (f"## Start **{step}** in run `{record.data['name']}`?\n\nTick *approve* and submit to start it; submit "
            f"unticked to reject it, which cancels the run.\n\n{tables or 'No stage has completed yet.'}")


def approve(timeout: int, step: str, record: RunRecord, log: Callable[[str], None]) -> str:
    """Pause until a person answers; return their note, or raise Rejected."""
    from prefect.flow_runs import pause_flow_run

    record.update(step, status="awaiting approval")
    log(f"{step}: waiting for approval: resume this flow run in the Prefect UI (approve, or not, with a note)")
    answer = pause_flow_run(wait_for_input=Approval.with_initial_data(description=done_so_far(record, step)),
                            timeout=timeout, poll_interval=POLL_SECONDS, key=f"approve-{step}")
    record.update(step, status="approved" if answer.approve else "rejected",
                  approval={"approve": answer.approve, "note": answer.note, "at": now()})
    if not answer.approve:
        raise Rejected(f"{step} was rejected at its approval gate" + (f": {answer.note}" if answer.note else ""))
    log(f"{step}: approved" + (f": {answer.note}" if answer.note else ""))
    return answer.note
