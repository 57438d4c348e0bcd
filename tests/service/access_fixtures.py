"""Fixtures of the access and query tests: the hand-built incident store served in-process, with one
token per role (operator, producer, a recipient tenant and a victim tenant)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from fastapi.testclient import TestClient

from kvtrail.service.app import create_app
from kvtrail.service.state import ServiceState, open_state
from kvtrail.service.tokens import add_token
from kvtrail.timeutil import format_utc
from tests.forensics.incident_fixture import W0, W1, build

WINDOW = {"from": format_utc(W0), "to": format_utc(W1)}


@dataclass
class Served:
    state: ServiceState
    client: TestClient
    tokens: dict[str, str]  # role name -> secret

    def get(self, path: str, role: str = "operator", **params):
        return self.client.get(path, params={**WINDOW, **params}, headers=bearer(self.tokens[role]))


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


@pytest.fixture(scope="module", name="served")
def served_fixture(tmp_path_factory) -> Iterator[Served]:
    db = tmp_path_factory.mktemp("incident") / "incident.duckdb"
    build(db)
    state = open_state(db)
    with state.write_lock:
        tokens = {
            role: add_token(state.store.con, role)[1]
            for role in ("operator", "producer", "tenant:mallory", "tenant:acme")
        }
    state.judge.wait_idle(60)
    with TestClient(create_app(state)) as client:
        yield Served(state, client, tokens)
    state.close()
