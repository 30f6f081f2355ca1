"""The hivemind record validator that protects node adverts (`NodeAdvertValidator`), installed on every DHT peer
gpuswarm runs: the coordinator's, each node daemon's, each training process's and the operators' `gpuswarm dht`.

Each node keeps one advert under `proto.dht.NODES_KEY` with its node id as the subkey. The validator accepts a
record there only if its value is a signed advert (`proto.dht.decode_advert`) whose signer, and whose payload,
name the node the subkey names, and if the record does not outlive the expiry the node signed (plus
`proto.dht.EXPIRY_SLACK`). So nobody can overwrite, or keep alive, another node's advert. Records under other keys
(hivemind's own progress and averaging keys) are left to the validators that own them.

`RecordValidatorBase` and `DHTRecord` are hivemind's public interface for validators; decoding the raw record
goes through `gpuswarm.dht.hivemind_adapter`.
"""

from __future__ import annotations

import logging

from gpuswarm.dht import hivemind_adapter
from gpuswarm.proto.dht import EXPIRY_SLACK, NODES_KEY, decode_advert
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from pydantic import ValidationError

logger = logging.getLogger(__name__)


class NodeAdvertValidator(RecordValidatorBase):
    def __init__(self) -> None:
        self._nodes_key_id = hivemind_adapter.key_id(NODES_KEY)

    def validate(self, record: DHTRecord) -> bool:
        if record.key != self._nodes_key_id:
            return True  # not ours to judge
        try:
            subkey = hivemind_adapter.unpack(record.subkey)
            advert = decode_advert(hivemind_adapter.unpack(record.value))
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
