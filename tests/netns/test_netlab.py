"""The lab helper itself: isolation between labs, shaping, and teardown after a failure."""

from __future__ import annotations

import netlab
import pytest

pytestmark = pytest.mark.timeout(60)


def test_parallel_labs_do_not_clash_and_leave_nothing_behind():
    with netlab.NetLab(2) as first, netlab.NetLab(2) as second:
        assert first.prefix != second.prefix
        assert first.addresses == second.addresses  # same subnet, separate bridges
        for lab in (first, second):
            assert lab.ping(0, lab.addresses[1]) and lab.ping(1, lab.addresses[0])
        assert set(netlab.list_namespaces(first.prefix)) == {first.hub, *first.namespaces}
    assert netlab.list_namespaces(first.prefix) == [] and netlab.list_namespaces(second.prefix) == []


def test_rate_shaping_uses_tbf_on_both_ends():
    with netlab.NetLab(2, shaping={0: netlab.Shaping(rate_mbit=50)}) as lab:
        node_side = lab.exec(0, ["tc", "qdisc", "show", "dev", "eth0"]).stdout
        hub_side = netlab._run(["tc", "-n", lab.hub, "qdisc", "show", "dev", "v0"]).stdout
        assert "tbf" in node_side and "50Mbit" in node_side
        assert "tbf" in hub_side
        assert "tbf" not in lab.exec(1, ["tc", "qdisc", "show", "dev", "eth0"]).stdout
        lab.shape(0, netlab.Shaping())
        assert "tbf" not in lab.exec(0, ["tc", "qdisc", "show", "dev", "eth0"]).stdout
        assert lab.ping(0, lab.addresses[1])


def test_delay_and_loss_use_netem_or_say_why_not():
    with netlab.NetLab(2) as lab:
        try:
            lab.shape(0, netlab.Shaping(delay_ms=5, loss_pct=0.5))
        except netlab.LabError as e:
            assert "netem" in str(e)
            pytest.skip("this kernel has no netem qdisc")
        assert "netem" in lab.exec(0, ["tc", "qdisc", "show", "dev", "eth0"]).stdout


def test_a_failure_half_way_through_building_tears_everything_down():
    class Failing(netlab.NetLab):
        def shape(self, i, shaping):
            raise netlab.LabError("injected")

    lab = Failing(3, shaping=netlab.Shaping(rate_mbit=10))
    with pytest.raises(netlab.LabError, match="injected"):
        lab.up()
    assert netlab.list_namespaces(lab.prefix) == []


def test_shaping_arguments():
    assert netlab.Shaping(delay_ms=20, jitter_ms=5, loss_pct=1, rate_mbit=100).tc_args() == [
        "netem", "delay", "20ms", "5ms", "loss", "1%", "rate", "100mbit"
    ]
    assert netlab.Shaping(rate_mbit=8).tc_args()[:3] == ["tbf", "rate", "8mbit"]
    assert netlab.Shaping().tc_args() == []
    with pytest.raises(ValueError):
        netlab.Shaping(loss_pct=101)
    with pytest.raises(ValueError):
        netlab.Shaping(jitter_ms=3)
    with pytest.raises(ValueError):
        netlab.NetLab(3, prefix="evil; rm -rf")
