"""Self-made certificates for a local control plane: a CA, serving and client certs, the SA key."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_VALIDITY = datetime.timedelta(days=2)


class Pki:
    """Writes PEM files into `directory`; every method returns the paths it wrote. One CA per instance."""

    def __init__(self, directory: Path, ca_name: str = "loraplane-e2e-ca") -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self._ca_key = ec.generate_private_key(ec.SECP256R1())
        self._ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ca_name)])
        now = datetime.datetime.now(datetime.timezone.utc)
        self._ca_cert = (
            x509.CertificateBuilder()
            .subject_name(self._ca_name)
            .issuer_name(self._ca_name)
            .public_key(self._ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + _VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(self._ca_key.public_key()), critical=False)
            .sign(self._ca_key, hashes.SHA256())
        )
        self.ca_file = self.directory / "ca.crt"
        self.ca_file.write_bytes(self._ca_cert.public_bytes(serialization.Encoding.PEM))

    def serving_cert(self, name: str, dns_names: list[str], ips: list[str]) -> tuple[Path, Path]:
        sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns_names]
        sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
        return self._issue(name, name, [], [ExtendedKeyUsageOID.SERVER_AUTH], sans)

    def peer_cert(self, name: str, dns_names: list[str], ips: list[str]) -> tuple[Path, Path]:
        """A cert for both ends of a mutual-TLS link (server and client auth), as KEDA's operator and metrics
        server share one for their gRPC link."""
        sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns_names]
        sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
        return self._issue(name, name, [], [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH], sans)

    def client_cert(self, name: str, user: str, groups: list[str]) -> tuple[Path, Path]:
        """A client cert: CN is the Kubernetes user name, each O one of its groups."""
        return self._issue(name, user, groups, [ExtendedKeyUsageOID.CLIENT_AUTH], [])

    def service_account_key(self) -> tuple[Path, Path]:
        """An RSA key pair for signing service-account tokens: (private key, public key)."""
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        private, public = self.directory / "sa.key", self.directory / "sa.pub"
        private.write_bytes(_private_pem(key))
        public.write_bytes(
            key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        )
        return private, public

    def _issue(
        self,
        name: str,
        common_name: str,
        organizations: list[str],
        usages: list[x509.ObjectIdentifier],
        sans: list[x509.GeneralName],
    ) -> tuple[Path, Path]:
        key = ec.generate_private_key(ec.SECP256R1())
        attributes = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in organizations]
        attributes.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
        now = datetime.datetime.now(datetime.timezone.utc)
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name(attributes))
            .issuer_name(self._ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + _VALIDITY)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(x509.KeyUsage(True, False, False, False, False, False, False, False, False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._ca_key.public_key()), critical=False
            )
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(self._ca_key, hashes.SHA256())
        cert_file, key_file = self.directory / f"{name}.crt", self.directory / f"{name}.key"
        cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_file.write_bytes(_private_pem(key))
        return cert_file, key_file


def _private_pem(key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()
    )
