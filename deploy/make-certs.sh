#!/usr/bin/env bash
# Certificates for the broker's TLS listeners (deploy/mosquitto.conf, ports 8883 and 8884), with openssl.
#
#   deploy/make-certs.sh mqtt.example.com [NAME|IP ...]   # the CAs (first time) and the server certificate
#   deploy/make-certs.sh --device-ca                      # only the device CA (first time), for 8884
#   deploy/make-certs.sh --client lamp-2                  # a client certificate (require_certificate)
#
# deploy/ca/        the broker CA's key and certificate: keep the key off the broker, back it up
# deploy/certs/     what the broker reads (mounted at /mosquitto/certs): ca.crt, server.crt,
#                   server.key, and device-ca.crt (the CA a device certificate must chain to on 8884)
# deploy/device-ca/ the device CA, which iotqueue's web signs device certificates with
#                   (POST /api/devices/<name>/certificate/; mounted read-only at /device-ca): ca.key,
#                   ca.crt, and broker-ca.crt (a copy of the broker CA, handed to devices to verify the broker)
# deploy/clients/   client certificates and keys, to hand to devices with ca.crt
#
# The server certificate names the given host names and IP addresses (what devices connect
# to), plus "mosquitto" and "localhost". Re-running it renews the server certificate with the
# same CA, so devices keep trusting it; delete deploy/ca to start a new CA.
set -euo pipefail
cd "$(dirname "$0")"

# A little over two years: what browsers and most TLS stacks accept for a leaf certificate.
DAYS=${DAYS:-825}
# The CA outlives the leaf certificates it signs: devices hold ca.crt for years.
CA_DAYS=${CA_DAYS:-3650}
# The uid of the mosquitto user in the eclipse-mosquitto image, which must read server.key.
BROKER_UID=1883

# The uid of the app user in iotqueue's image (the web signs device certificates with
# deploy/device-ca/ca.key); find it with: docker compose run --rm --no-deps --entrypoint id web -u
APP_UID=${APP_UID:-}

usage() {
  sed -n '4,6p' "${BASH_SOURCE[0]##*/}" | sed 's/^# *//' >&2
  exit 2
}

# The device CA: a CA of its own, so the key the web holds can make device identities only,
# never a certificate the broker would present as itself.
device_ca_ensure() {
  mkdir -p device-ca certs
  chmod 700 device-ca
  if [[ ! -f device-ca/ca.key ]]; then
    openssl req -x509 -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -sha256 -days "$CA_DAYS" \
      -subj "/CN=iotqueue device CA" \
      -addext "basicConstraints=critical,CA:TRUE,pathlen:0" -addext "keyUsage=critical,keyCertSign,cRLSign" \
      -keyout device-ca/ca.key -out device-ca/ca.crt 2>/dev/null
    chmod 600 device-ca/ca.key
    echo "made the device CA: deploy/device-ca/ca.crt (key deploy/device-ca/ca.key)"
  fi
  cp device-ca/ca.crt certs/device-ca.crt
  chmod 644 certs/device-ca.crt device-ca/ca.crt
  if [[ -f ca/ca.crt ]]; then
    cp ca/ca.crt device-ca/broker-ca.crt
    chmod 644 device-ca/broker-ca.crt
  fi
  # The web container reads the key as its own user, and the directory must let it in.
  if [[ $(id -u) == 0 && -n $APP_UID ]]; then
    chown "$APP_UID" device-ca device-ca/ca.key
  else
    echo "note: iotqueue's web container (its app user's uid: APP_UID above) must read deploy/device-ca/ca.key:" >&2
    echo "      sudo APP_UID=<uid> deploy/make-certs.sh --device-ca   (or chown <uid> deploy/device-ca deploy/device-ca/ca.key)" >&2
  fi
}

ca_ensure() {
  mkdir -p ca certs
  chmod 700 ca
  if [[ ! -f ca/ca.key ]]; then
    openssl req -x509 -new -newkey rsa:3072 -nodes -sha256 -days "$CA_DAYS" \
      -subj "/CN=iotqueue MQTT CA" \
      -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
      -keyout ca/ca.key -out ca/ca.crt 2>/dev/null
    chmod 600 ca/ca.key
    echo "made the CA: deploy/ca/ca.crt (key deploy/ca/ca.key)"
  fi
  cp ca/ca.crt certs/ca.crt
}

# sign NAME KEY CERT EXTENSIONS: a new key and a certificate for it, signed by the CA.
sign() {
  local name=$1 key=$2 cert=$3 extensions=$4 csr
  csr=$(mktemp)
  openssl req -new -newkey rsa:3072 -nodes -sha256 -subj "/CN=$name" -keyout "$key" -out "$csr" 2>/dev/null
  chmod 600 "$key"
  openssl x509 -req -sha256 -days "$DAYS" -in "$csr" -CA ca/ca.crt -CAkey ca/ca.key \
    -CAserial ca/ca.srl -CAcreateserial -extfile <(printf '%s\n' "$extensions") -out "$cert" 2>/dev/null
  rm -f "$csr"
}

server_cert() {
  local names=("$@" mosquitto localhost) alt=() name
  for name in "${names[@]}"; do
    if [[ $name =~ ^[0-9.]+$ || $name == *:* ]]; then alt+=("IP:$name"); else alt+=("DNS:$name"); fi
  done
  ca_ensure
  sign "$1" certs/server.key certs/server.crt "$(printf '%s\n' \
    "basicConstraints=CA:FALSE" "keyUsage=critical,digitalSignature,keyEncipherment" \
    "extendedKeyUsage=serverAuth" "subjectAltName=$(IFS=,; echo "${alt[*]}")")"
  chmod 644 certs/ca.crt certs/server.crt
  # The broker reads the key as its own user (Mosquitto 2 drops root before loading it).
  if [[ $(id -u) == 0 ]]; then
    chown "$BROKER_UID" certs/server.key
  else
    echo "note: the broker (uid $BROKER_UID in its container) must read deploy/certs/server.key:" >&2
    echo "      sudo chown $BROKER_UID deploy/certs/server.key" >&2
  fi
  echo "made the server certificate deploy/certs/server.crt for: ${names[*]}"
  # The broker's 8884 listener (certificate devices) reads certs/device-ca.crt.
  device_ca_ensure
}

client_cert() {
  local name=$1
  [[ -f ca/ca.key ]] || { echo "no CA yet: make the server certificate first" >&2; exit 1; }
  mkdir -p clients
  sign "$name" "clients/$name.key" "clients/$name.crt" "$(printf '%s\n' \
    "basicConstraints=CA:FALSE" "keyUsage=critical,digitalSignature" "extendedKeyUsage=clientAuth")"
  echo "made the client certificate deploy/clients/$name.crt (key deploy/clients/$name.key)"
}

case "${1:-}" in
  "" | -h | --help) usage ;;
  --client) [[ $# == 2 ]] || usage; client_cert "$2" ;;
  --device-ca) [[ $# == 1 ]] || usage; device_ca_ensure ;;
  *) server_cert "$@" ;;
esac
