from __future__ import annotations

from controlplane.fleet.models import LLMModel
from tests.controlplane.crud import CRUDTests


class TestModelAPI(CRUDTests):
    url = "/api/v1/models/"
    model = LLMModel
    create_data = {"name": "Qwen/Qwen2.5-7B-Instruct", "kv_block_size": 16, "max_context_tokens": 32768}
    update_data = {"kv_block_size": 32, "max_context_tokens": 131072}

    def make(self, index: int) -> LLMModel:
        return LLMModel.objects.create(name=f"org/model-{index}")

    def test_it_filters_by_name(self, viewer_client) -> None:
        self.make(1)
        response = viewer_client.get(self.url, {"q": "model-1"})
        assert [m["name"] for m in response.json()["results"]] == ["org/model-1"]
