//! TLS of the HTTP listeners (rustls, `ring` provider).
//!
//! Why `ring`: it builds with the C compiler every machine here has (the
//! `aws-lc-rs` provider wants CMake and more), and the region-node's gRPC
//! listener uses the same provider, so one crypto backend is linked. The
//! provider is passed explicitly rather than installed process-wide, so no
//! other crate's default can swap it.
//!
//! Certificates are read at start; a new certificate needs a restart (the
//! files are named in `[http]`, which SIGHUP does not re-apply).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use thiserror::Error;

/// A TLS setting that cannot be used, naming the file.
#[derive(Debug, Error)]
pub enum TlsError {
    #[error("{key} = {path}: {reason}")]
    File {
        key: &'static str,
        path: PathBuf,
        reason: String,
    },
    #[error("TLS configuration refused: {0}")]
    Rustls(#[from] rustls::Error),
}

fn file_err(key: &'static str, path: &Path, reason: impl ToString) -> TlsError {
    TlsError::File {
        key,
        path: path.to_path_buf(),
        reason: reason.to_string(),
    }
}

/// The crypto provider every TLS config here is built with.
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Reads a PEM certificate chain.
pub fn load_certs(
    key: &'static str,
    path: &Path,
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| file_err(key, path, e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| file_err(key, path, e))?;
    if certs.is_empty() {
        return Err(file_err(key, path, "no PEM certificate in the file"));
    }
    Ok(certs)
}

/// The server config of a listener: its certificate and key and, with a
/// client CA, optional client certificates verified against that CA
/// (a client without one may still authenticate with an API key).
pub fn server_config(
    cert: &Path,
    key: &Path,
    client_ca: Option<&Path>,
) -> Result<Arc<ServerConfig>, TlsError> {
    let chain = load_certs("http.tls_cert", cert)?;
    let private =
        PrivateKeyDer::from_pem_file(key).map_err(|e| file_err("http.tls_key", key, e))?;
    let builder =
        ServerConfig::builder_with_provider(provider()).with_safe_default_protocol_versions()?;
    let builder = match client_ca {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let mut roots = RootCertStore::empty();
            for c in load_certs("http.tls_client_ca", ca)? {
                roots
                    .add(c)
                    .map_err(|e| file_err("http.tls_client_ca", ca, e))?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
                .allow_unauthenticated()
                .build()
                .map_err(|e| file_err("http.tls_client_ca", ca, e))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder
        .with_single_cert(chain, private)
        .map_err(|e| file_err("http.tls_key", key, e))?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// The DNS subject-alternative names of a verified client certificate
/// (what `auth.clients.*.dns_name` matches).
pub fn dns_names(cert: &CertificateDer<'_>) -> Vec<String> {
    match webpki::EndEntityCert::try_from(cert) {
        Ok(ee) => ee.valid_dns_names().map(str::to_owned).collect(),
        Err(_) => Vec::new(),
    }
}
