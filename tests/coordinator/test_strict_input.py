"""Owner and operator input is strict over the real API; node messages are not.

An unknown key or a wrongly typed value in a job spec or an admin request is a 422 that names the key by its full
path and, when one is close, the key meant, in the same words the job owner's CLI prints for a job file; the
database is left exactly as it was. A node's signed messages still ignore fields they do not know, so that mixed
versions still talk. Real aiohttp app over real HTTP, a real database (every backend of `database_url`).
"""

from __future__ import annotations

import tomllib

import pytest
from aiohttp.test_utils import TestServer
from gpuswarm.client.jobfile import JobFileError, build_spec
from gpuswarm.coordinator.app import create_app
from gpuswarm.coordinator.config import ADMIN_TOKEN, CoordinatorConfig
from test_api import (
    SharedServerClient,
    job_spec,
    new_identity,
    new_owner_token,
    register,
    registration,
    rejected,
    signed,
    wait_for_assignment,
)


@pytest.fixture
async def server(tmp_path, database_url):
    app = create_app(CoordinatorConfig(data_dir=tmp_path / "coordinator", database_url=database_url,
                                       start_dht=False, loop_interval=0.2))
    async with TestServer(app) as server:
        yield server


@pytest.fixture
async def admin(server):
    async with SharedServerClient(server, headers={"Authorization": f"Bearer {server.app[ADMIN_TOKEN]}"}) as client:
        yield client


@pytest.fixture
async def owner(server):
    token = await new_owner_token(server, server.app, "owner", 100.0)
    async with SharedServerClient(server, headers={"Authorization": f"Bearer {token}"}) as client:
        yield client


def lines(error: dict) -> set[str]:
    """The API's details as "field: message" lines, the form the CLI prints them in."""
    return {f"{d['field']}: {d['message']}" for d in error["details"]}


# ---------------------------------------------------------------------------------------------------- job specs


@pytest.mark.parametrize(("spec", "line"), [
    (job_spec(budgett=5), "budgett: unknown key; did you mean 'budget'?"),
    (job_spec(max_node=2), "max_node: unknown key; did you mean 'max_nodes'?"),
    (job_spec(stop={"max_epoch": 3}), "stop.max_epoch: unknown key; did you mean 'max_epochs'?"),
    (job_spec(requirements={"verified": True}), "requirements.verified: unknown key; did you mean 'verified_only'?"),
    (job_spec(hyperparameters={"hiden": 32}), "hyperparameters.hiden: unknown key; did you mean 'hidden'?"),
])
async def test_an_unknown_key_is_422_naming_it_and_the_key_meant(owner, spec, line):
    error = await rejected(owner, "POST", "/v1/jobs", 422, "invalid", json=spec)
    assert error["message"] == f"invalid job spec: {line}"
    assert lines(error) == {line}


async def test_an_unknown_key_close_to_nothing_lists_the_known_keys(owner):
    error = await rejected(owner, "POST", "/v1/jobs", 422, "invalid", json=job_spec(colour="red"))
    assert error["details"][0]["field"] == "colour"
    assert error["details"][0]["message"].startswith("unknown key; the known keys are name, workload, ")


@pytest.mark.parametrize(("overrides", "line"), [
    ({"max_nodes": "2"}, "max_nodes: Input should be a valid integer, got the string '2'"),
    ({"min_nodes": True}, "min_nodes: Input should be a valid integer, got the boolean true"),
    ({"budget": "5"}, "budget: Input should be a valid number, got the string '5'"),
    ({"requirements": {"verified_only": "yes"}},
     "requirements.verified_only: Input should be a valid boolean, got the string 'yes'"),
    ({"stop": {"max_epochs": 2.5}}, "stop.max_epochs: Input should be a valid integer, got the number 2.5"),
    ({"hyperparameters": {"hidden": "32"}},
     "hyperparameters.hidden: Input should be a valid integer, got the string '32'"),
])
async def test_a_wrongly_typed_value_is_422_naming_its_key(owner, overrides, line):
    error = await rejected(owner, "POST", "/v1/jobs", 422, "invalid", json=job_spec(**overrides))
    assert lines(error) == {line}
    assert line in error["message"]


async def test_every_problem_is_in_the_details_and_the_first_three_in_the_message(owner):
    spec = job_spec(budgett=5, max_node=2, stop={"max_epoch": 3}, min_nodes="1")
    error = await rejected(owner, "POST", "/v1/jobs", 422, "invalid", json=spec)
    assert lines(error) == {"budgett: unknown key; did you mean 'budget'?",
                            "max_node: unknown key; did you mean 'max_nodes'?",
                            "stop.max_epoch: unknown key; did you mean 'max_epochs'?",
                            "min_nodes: Input should be a valid integer, got the string '1'"}
    assert error["message"].startswith("invalid job spec: ")
    assert sum(line in error["message"] for line in lines(error)) == 3


async def test_the_api_and_the_job_file_say_the_same(owner, tmp_path):
    text = """\
workload = "digits-mlp"
budgett = 5
max_nodes = "2"
[stop]
max_epoch = 3
[hyperparameters]
hiden = 32
"""
    file = tmp_path / "job.toml"
    file.write_text(text)
    with pytest.raises(JobFileError) as caught:
        build_spec(file, {}, [])
    cli_lines = {line.strip() for line in str(caught.value).splitlines()[1:]}
    error = await rejected(owner, "POST", "/v1/jobs", 422, "invalid", json=tomllib.loads(text))
    assert lines(error) == cli_lines
    assert "budgett: unknown key; did you mean 'budget'?" in cli_lines


async def test_a_whole_number_for_a_float_is_accepted(owner):
    response = await owner.post("/v1/jobs", json=job_spec(budget=5, max_price_per_gpu_hour=2,
                                                           hyperparameters={"hidden": 32, "learning_rate": 1}))
    assert response.status == 201, await response.text()
    spec = (await response.json())["spec"]
    assert spec["budget"] == 5.0 and spec["max_price_per_gpu_hour"] == 2.0
    assert spec["hyperparameters"]["learning_rate"] == 1.0


async def test_a_strict_spec_still_reaches_its_node(owner):
    node = await register(owner)
    response = await owner.post("/v1/jobs", json=job_spec(budget=0))
    assert response.status == 201, await response.text()
    assignment = await wait_for_assignment(owner, node, (await response.json())["id"])
    assert assignment["spec"]["stop"]["max_epochs"] == 2


# ---------------------------------------------------------------------------------------------------- admin


@pytest.mark.parametrize(("body", "line"), [
    ({"name": "ann", "credit": 5}, "credit: unknown key; did you mean 'credits'?"),
    ({"name": "ann", "credits": "5"}, "credits: Input should be a valid number, got the string '5'"),
    ({"name": "ann", "credits": True}, "credits: Input should be a valid number, got the boolean true"),
    ({"name": 7}, "name: Input should be a valid string, got the number 7"),
])
async def test_a_bad_new_owner_is_422_naming_the_key(admin, body, line):
    error = await rejected(admin, "POST", "/v1/owners", 422, "invalid", json=body)
    assert lines(error) == {line}
    assert error["message"] == f"invalid owner: {line}"


@pytest.mark.parametrize(("body", "line"), [
    ({"amount": 5, "meno": "gift"}, "meno: unknown key; did you mean 'memo'?"),
    ({"amount": "5"}, "amount: Input should be a valid number, got the string '5'"),
    ({"amount": 5, "memo": 3}, "memo: Input should be a valid string, got the number 3"),
])
async def test_a_bad_credit_adjustment_is_422_naming_the_key(admin, owner, body, line):
    owner_id = (await (await owner.get("/v1/owners/me")).json())["id"]
    error = await rejected(admin, "POST", f"/v1/owners/{owner_id}/credits", 422, "invalid", json=body)
    assert lines(error) == {line}


async def test_whole_numbers_are_fine_credits(admin, owner):
    owner_id = (await (await owner.get("/v1/owners/me")).json())["id"]
    response = await admin.post(f"/v1/owners/{owner_id}/credits", json={"amount": 5})
    assert response.status == 200, await response.text()
    assert (await response.json())["balance"] == 105.0


# ---------------------------------------------------------------------------------------------------- nodes


async def test_node_messages_still_ignore_unknown_fields(owner):
    node = new_identity()
    payload = registration(node, from_a_newer_node=1)
    payload["resources"] = payload["resources"] | {"tpus": 2}
    response = await owner.post("/v1/nodes/register", json=signed(node, "register", payload))
    assert response.status == 200, await response.text()
    response = await owner.post("/v1/nodes/heartbeat", json=signed(node, "heartbeat", {
        "node_id": node.node_id, "state": "idle", "from_a_newer_node": {"x": 1}}))
    assert response.status == 200, await response.text()
