"""The job lifecycle (coordinator/jobs.py): the pure transition table, property-tested over random event
sequences, and `apply` on a real SQLite database (columns, history line, assignments closed, refusals)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from gpuswarm.coordinator import jobs
from gpuswarm.coordinator.db import AssignmentRow, Base, Job, JobEvent, Node, Owner, make_engine, sessionmaker
from gpuswarm.coordinator.jobs import TRANSITIONS, Event, IllegalTransition, Refusal, next_state
from gpuswarm.proto.models import AssignmentState, JobState
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy import select

FINAL = [s for s in JobState if s.is_final]
TABLE_LINE = re.compile(r"^\s+(\w+)\s+--(\w+)-->\s+(\w+)\s", re.MULTILINE)

events = st.lists(st.sampled_from(list(Event)), max_size=30)
times = st.lists(st.floats(min_value=1.0, max_value=2e9, allow_nan=False), min_size=30, max_size=30)


def test_the_table_is_the_one_in_the_docstring():
    documented = {(JobState(a), Event(e)): JobState(b) for a, e, b in TABLE_LINE.findall(jobs.__doc__)}
    assert documented == TRANSITIONS


def test_every_event_leads_to_one_state_and_is_allowed_from_some():
    for event in Event:
        assert {to for (_, e), to in TRANSITIONS.items() if e is event} == {jobs.target(event)}
        assert jobs.sources(event)


@pytest.mark.parametrize("state", FINAL)
@pytest.mark.parametrize("event", list(Event))
def test_final_states_absorb(state: JobState, event: Event):
    assert next_state(state, event) == Refusal(state, event)


def test_only_start_leaves_pending_for_running_and_nothing_leads_back():
    assert [e for (s, e), to in TRANSITIONS.items() if to is JobState.RUNNING] == [Event.START]
    assert all(to is not JobState.PENDING for to in TRANSITIONS.values())


def walk(event_list: list[Event], at: list[float]) -> tuple[Job, list[JobState], list[IllegalTransition]]:
    """Play events on a job row (no database): what `apply` writes on the row, and the refusals it raises."""
    job = Job(id="j-000000000001", state=jobs.INITIAL.value, created_at=0.0)
    states, refusals = [JobState(job.state)], []
    for event, now in zip(event_list, at, strict=False):
        result = next_state(JobState(job.state), event)
        if isinstance(result, Refusal):
            refusals.append(result.error(job.id))
        else:
            jobs.enter(job, result, now)
        states.append(JobState(job.state))
    return job, states, refusals


@given(events, times)
def test_random_event_sequences_follow_the_table(event_list, at):
    _, states, _ = walk(event_list, at)
    for before, event, after in zip(states, event_list, states[1:], strict=False):
        assert after == TRANSITIONS.get((before, event), before)
    for before, after in zip(states, states[1:], strict=False):
        if before.is_final:
            assert after is before  # final states absorb


@given(events, times)
def test_started_at_is_set_once_at_the_start(event_list, at):
    job, states, _ = walk(event_list, at)
    if JobState.RUNNING in states:
        first = states.index(JobState.RUNNING)  # states[i + 1] follows event_list[i]
        assert event_list[first - 1] is Event.START and job.started_at == at[first - 1]
    else:
        assert job.started_at is None


@given(events, times)
def test_finished_at_is_set_once_when_the_job_ends(event_list, at):
    job, states, _ = walk(event_list, at)
    ended = [i for i, s in enumerate(states) if s.is_final]
    if ended:
        assert job.finished_at == at[ended[0] - 1]
        assert all(states[i].is_final for i in range(ended[0], len(states)))
    else:
        assert job.finished_at is None


@given(events, times)
def test_every_refusal_is_a_409_naming_both_states(event_list, at):
    _, states, refusals = walk(event_list, at)
    refused = [(s, e) for s, e in zip(states, event_list, strict=False) if (s, e) not in TRANSITIONS]
    assert len(refusals) == len(refused)
    for error, (state, event) in zip(refusals, refused, strict=True):
        assert error.status == 409
        assert error.code == ("job_final" if state.is_final else "job_not_running")
        assert f"is {state.value};" in error.message
        assert jobs.target(event).value in error.message and event.verb in error.message
        assert (error.current, error.event) == (state, event)


def test_refusal_message_reads_well():
    error = next_state(JobState.COMPLETED, Event.CANCEL).error("j-123")
    assert error.message == ("job j-123 is completed; cannot cancel a completed job (only a pending or running "
                             "job can become cancelled)")


# ---------------------------------------------------------------------------------------------------- apply


@pytest.fixture
async def sessions(tmp_path: Path):
    engine = make_engine(f"sqlite+aiosqlite:///{tmp_path / 'jobs.db'}")
    async with engine.begin() as connection:
        await connection.run_sync(Base.metadata.create_all)
    yield sessionmaker(engine)
    await engine.dispose()


async def running_job(sessions, members: int = 2) -> str:
    async with sessions.begin() as session:
        session.add(Owner(id="o-1", name="owner", token_hash="0" * 64, created_at=0.0))
        await session.flush()  # no relationship() tells the unit of work to insert the owner first
        job = jobs.create(session, name="job", spec={}, owner_id="o-1", now=1.0, message="submitted")
        await session.flush()
        for i in range(members):
            session.add(Node(id=f"n{i}", public_key=f"key{i}", resources={}, software_version="t", endpoints=[],
                             state="training", registered_at=0.0, last_seen=0.0))
            await session.flush()
            session.add(AssignmentRow(job_id=job.id, node_id=f"n{i}", state=AssignmentState.ACTIVE.value,
                                      shard_index=i, num_shards=members, created_at=1.0))
        await jobs.apply(session, job, Event.START, 2.0, "running")
        return job.id


async def rows(sessions, job_id: str) -> tuple:
    async with sessions() as session:
        job = await session.get(Job, job_id)
        assignments = (await session.scalars(select(AssignmentRow).where(AssignmentRow.job_id == job_id))).all()
        history = (await session.scalars(select(JobEvent.message).where(JobEvent.job_id == job_id)
                                         .order_by(JobEvent.id))).all()
        return ((job.state, job.started_at, job.finished_at, job.error),
                [(a.state, a.ended_at, a.reason) for a in assignments], list(history))


@pytest.mark.parametrize("event, state, closing", [
    (Event.CANCEL, JobState.CANCELLED, AssignmentState.CANCELLED),
    (Event.FINAL_MODEL, JobState.COMPLETED, AssignmentState.FINISHED),
    (Event.TOO_MANY_FAILURES, JobState.FAILED, AssignmentState.FINISHED),
    (Event.BUDGET_EXHAUSTED, JobState.FAILED, AssignmentState.FINISHED),
])
async def test_apply_ends_a_running_job_and_closes_its_assignments(sessions, event, state, closing):
    job_id = await running_job(sessions)
    async with sessions.begin() as session:
        job = await session.get(Job, job_id)
        assert await jobs.apply(session, job, event, 3.0, "it ended", error="why") is state
    job_row, assignments, history = await rows(sessions, job_id)
    assert job_row == (state.value, 2.0, 3.0, "why")
    assert assignments == [(closing.value, 3.0, "it ended")] * 2
    assert history == ["submitted", "running", "it ended"]


async def test_a_refused_event_writes_nothing(sessions):
    job_id = await running_job(sessions)
    async with sessions.begin() as session:
        await jobs.apply(session, await session.get(Job, job_id), Event.CANCEL, 3.0, "cancelled")
    before = await rows(sessions, job_id)
    for event in Event:
        with pytest.raises(IllegalTransition) as refused:
            async with sessions.begin() as session:
                await jobs.apply(session, await session.get(Job, job_id), event, 4.0, "again")
        assert refused.value.code == "job_final" and "cancelled" in refused.value.message
        assert await rows(sessions, job_id) == before
