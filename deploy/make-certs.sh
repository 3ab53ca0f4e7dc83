#!/usr/bin/env bash
# Certificates for the broker's TLS listener (deploy/mosquitto.conf, port 8883), with openssl.
#
#   deploy/make-certs.sh mqtt.example.com [NAME|IP ...]   # the CA (first time) and the server certificate
#   deploy/make-certs.sh --client lamp-2                  # a client certificate (require_certificate)
#
# deploy/ca/      the CA's key and certificate: keep the key off the broker, back it up
# deploy/certs/   what the broker reads (mounted at /mosquitto/certs): ca.crt, server.crt, server.key
# deploy/clients/ client certificates and keys, to hand to devices with ca.crt
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

usage() {
  sed -n '4,5p' "${BASH_SOURCE[0]##*/}" | sed 's/^# *//' >&2
  exit 2
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
  *) server_cert "$@" ;;
esac
