"""A class that overrides a private method of torch's agent: the sample the launcher's public-API check must
refuse (tests/unit/test_launcher_public_torch.py)."""
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent


class Agent(LocalElasticAgent):
    def _monitor_workers(self, worker_group):  # type: ignore[no-untyped-def]
        return super()._monitor_workers(worker_group)

    def _own_helper(self) -> None:
        """A private method of deepshard's own: not an override; but the field it reads is torch's."""
        self._pcontext.close()
