"""DHT key names, the record validator that protects node adverts, and the DHT class every gpuswarm process uses.

Each node keeps one advert under `NODES_KEY` with its node id as the subkey. The value is a signed envelope
(kind "advert"); `NodeAdvertValidator` accepts it only if the signer's derived node id equals the subkey, the
payload names that node, and the record does not outlive the expiry the node signed. So nobody can overwrite,
or keep alive, another node's advert. Records under other keys (hivemind's own progress and averaging keys) are
left to the validators that own them.

`SwarmDHT` is hivemind's DHT, except that its process never outlives the process that started it. Forked from a
daemon with a SIGTERM handler of its own (aiohttp's run_app, asyncio's add_signal_handler, the worker's stop flag),
hivemind's DHT process inherited that handler, ignored the SIGTERM of `DHT.shutdown`'s last resort, and was found
alive half an hour after its coordinator had exited. A SwarmDHT process ignores SIGTERM on purpose (a signal to
the whole process group, from systemd or a terminal, is for its owner, which still needs the DHT to say goodbye),
gets SIGKILL when its owner dies (PR_SET_PDEATHSIG), and `terminate`, the last resort, is SIGKILL.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal

import hivemind
from gpuswarm.proto.models import NodeAdvert
from gpuswarm.proto.signing import SignatureError, SignedEnvelope, verify
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer
from pydantic import ValidationError

logger = logging.getLogger(__name__)

NODES_KEY = "gpuswarm.nodes"
ADVERT_KIND = "advert"
EXPIRY_SLACK = 5.0  # seconds a record may outlive its signed expiry (clock skew between peers)


PR_SET_PDEATHSIG = 1


class SwarmDHT(hivemind.DHT):
    def __init__(self, *args, **kwargs):
        self._owner_pid = os.getpid()  # before hivemind's __init__, which may start the process
        super().__init__(*args, **kwargs)

    def run(self) -> None:  # in the forked DHT process
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != self._owner_pid:  # the owner died before prctl took effect
            os._exit(1)
        super().run()

    def terminate(self) -> None:  # hivemind's DHT.shutdown calls it when the process did not stop in time
        self.kill()


def job_run_id(job_id: str) -> str:
    """The hivemind run id of a job; hivemind derives its progress and averaging keys from it."""
    return f"gpuswarm_{job_id.replace('-', '_')}"


def decode_advert(envelope: dict) -> NodeAdvert:
    """Verify a signed advert (as stored in the DHT) and return it. Raise ValueError when it is not valid."""
    env = SignedEnvelope.model_validate(envelope)
    # The DHT record's own expiry bounds an advert's life; the envelope timestamp only needs to be sane.
    signer = verify(env, kind=ADVERT_KIND, max_skew=float("inf"))
    advert = NodeAdvert.model_validate(env.payload)
    if advert.node_id != signer:
        raise SignatureError("advert is not signed by the node it describes")
    return advert


class NodeAdvertValidator(RecordValidatorBase):
    def __init__(self) -> None:
        self._nodes_key_id = DHTID.generate(source=NODES_KEY).to_bytes()

    def validate(self, record: DHTRecord) -> bool:
        if record.key != self._nodes_key_id:
            return True  # not ours to judge
        try:
            subkey = MSGPackSerializer.loads(record.subkey)
            advert = decode_advert(MSGPackSerializer.loads(record.value))
        except (ValueError, ValidationError, TypeError, KeyError) as e:
            logger.debug("rejected advert record: %s", e)
            return False
        except Exception as e:  # malformed msgpack raises library-specific errors; never let it reach the DHT loop
            logger.debug("rejected undecodable advert record: %r", e)
            return False
        if subkey != advert.node_id:
            return False
        return record.expiration_time <= advert.expires_at + EXPIRY_SLACK

    @property
    def priority(self) -> int:
        return 10
