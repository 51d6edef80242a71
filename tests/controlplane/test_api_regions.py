from __future__ import annotations

from controlplane.fleet.models import Region
from tests.controlplane.crud import CRUDTests


class TestRegionAPI(CRUDTests):
    url = "/api/v1/regions/"
    model = Region
    create_data = {
        "slug": "us-west",
        "name": "US West (Oregon)",
        "latitude": 45.84,
        "longitude": -119.7,
        "provider": "aws",
        "zone": "us-west-2",
    }
    update_data = {"name": "Oregon", "latitude": 45.5, "zone": "us-west-2a"}

    def make(self, index: int) -> Region:
        return Region.objects.create(
            slug=f"region-{index}", name=f"Region {index}", latitude=index, longitude=-index
        )

    def test_it_counts_nodes_and_filters_by_slug(self, viewer_client, fleet) -> None:
        response = viewer_client.get(self.url, {"slug": "eu-central"})
        assert response.status_code == 200
        [region] = response.json()["results"]
        assert region["slug"] == "eu-central"
        assert region["node_count"] == 2
