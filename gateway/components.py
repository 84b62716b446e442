"""What a running gateway holds; built once by :func:`gateway.app.create_app`."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from gateway.admission import Admissions
from gateway.auth import Authenticator
from gateway.control_store import ControlStore
from gateway.publisher import RunPublisher
from gateway.ratelimit import TokenBuckets
from gateway.store import RunStore
from gateway.sweeper import Sweeper
from koda.settings import Settings


@dataclass(frozen=True)
class Components:
    settings: Settings
    auth: Authenticator
    limiter: TokenBuckets
    store: RunStore
    publisher: RunPublisher
    admissions: Admissions
    sweeper: Sweeper
    control: ControlStore


def components_of(request: Request) -> Components:
    """The gateway's components, set on ``app.state`` by the lifespan."""
    components = getattr(request.app.state, "components", None)
    if not isinstance(components, Components):
        raise RuntimeError("the gateway is not started: its lifespan did not run")
    return components
