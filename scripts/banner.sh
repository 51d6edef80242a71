#!/usr/bin/env bash
# Printed by `make run` once the demo is seeded and before the processes start.
cat <<TEXT

  gorgo is starting (Ctrl-C stops everything)

  control plane   http://127.0.0.1:8000/          log in as operator / ${GORGO_OPERATOR_PASSWORD}   (kept in var/operator-password)
  REST API        http://127.0.0.1:8000/api/v1/   docs: http://127.0.0.1:8000/api/docs/
                  token kept in var/api-token:    TOKEN=$(cat var/api-token)
  gateways        us-east http://127.0.0.1:9001   eu-central http://127.0.0.1:9002   ap-south http://127.0.0.1:9003
  client key      ${GORGO_DEMO_KEY:-(see var/demo-key)}   (var/demo-key; send as Authorization: Bearer <key>)
  emulated nodes  http://127.0.0.1:8101 ... 8106  (simulator/topologies/default.toml)
  redis           ${REDIS_URL}
  demo traffic    geo-chat to the three gateways, stops by itself after ${GORGO_DEMO_DURATION_S:-3600} s

TEXT
