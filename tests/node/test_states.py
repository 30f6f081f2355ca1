import pytest
from gpuswarm.node.states import Facts, next_state
from gpuswarm.proto.models import NodeState as S


def walk(start: S, facts: list[Facts]) -> list[S]:
    states, state = [], start
    for f in facts:
        state = next_state(state, f)
        states.append(state)
    return states


def test_typical_life():
    facts = [
        Facts(),                                                      # just started
        Facts(registered=True),                                       # coordinator accepted us
        Facts(registered=True, training=True),                        # assignment arrives
        Facts(registered=True, training=True, coordinator_reachable=False),  # outage while training
        Facts(registered=True, coordinator_reachable=False),          # job finished, still no coordinator
        Facts(registered=False),                                      # coordinator back, forgot us
        Facts(registered=True),
        Facts(registered=True, training=True),
        Facts(registered=True, training=True, stop_requested=True),   # Ctrl-C: drain
        Facts(registered=True, stop_requested=True),                  # drained
        Facts(registered=True),                                       # nothing brings it back
    ]
    assert walk(S.STARTING, facts) == [
        S.REGISTERING, S.IDLE, S.TRAINING, S.TRAINING, S.DISCONNECTED, S.REGISTERING, S.IDLE, S.TRAINING,
        S.STOPPING, S.OFFLINE, S.OFFLINE,
    ]


@pytest.mark.parametrize("current", [s for s in S if s is not S.OFFLINE])
def test_stop_while_training_drains_first(current):
    assert next_state(current, Facts(stop_requested=True, registered=True, training=True)) is S.STOPPING


@pytest.mark.parametrize("current", [s for s in S if s is not S.OFFLINE])
@pytest.mark.parametrize("registered", [True, False])
def test_stop_when_not_training_goes_offline(current, registered):
    assert next_state(current, Facts(stop_requested=True, registered=registered)) is S.OFFLINE


@pytest.mark.parametrize("facts", [Facts(), Facts(registered=True), Facts(registered=True, training=True),
                                   Facts(stop_requested=True, training=True)])
def test_offline_is_final(facts):
    assert next_state(S.OFFLINE, facts) is S.OFFLINE


@pytest.mark.parametrize("current", [S.STARTING, S.IDLE, S.TRAINING, S.DISCONNECTED])
def test_unregistered_registers_first_even_while_training(current):
    assert next_state(current, Facts(registered=False, training=True)) is S.REGISTERING
    assert next_state(current, Facts(registered=False, coordinator_reachable=False)) is S.REGISTERING


def test_training_beats_unreachable():
    assert next_state(S.IDLE, Facts(registered=True, training=True, coordinator_reachable=False)) is S.TRAINING


def test_unreachable_idle_is_disconnected_and_recovers():
    assert next_state(S.IDLE, Facts(registered=True, coordinator_reachable=False)) is S.DISCONNECTED
    assert next_state(S.DISCONNECTED, Facts(registered=True)) is S.IDLE
