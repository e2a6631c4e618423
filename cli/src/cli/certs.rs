//! `chorus certs`: a development CA, server and client certificates for NATS with TLS.

use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// Directory to write ca.pem, server.pem, server-key.pem, client.pem, client-key.pem, and
    /// nats-tls.conf (the server's tls block, for `include` in its config).
    #[arg(long, default_value = ".tls")]
    out: PathBuf,
    /// Names and addresses the server certificate is for.
    #[arg(long = "host", default_values = ["localhost", "127.0.0.1"])]
    hosts: Vec<String>,
    /// The client certificate's common name.
    #[arg(long, default_value = "chorus-client")]
    client: String,
}

/// The file, in the output directory, that holds the server's tls block.
const TLS_CONF: &str = "nats-tls.conf";

pub(crate) fn run(args: Args) -> anyhow::Result<ExitCode> {
    let files = chorus_cli::certs::generate(&args.out, &args.hosts, &args.client)?;
    outln!("CA:     {}", files.ca.display());
    outln!(
        "server: {} (key {})",
        files.server_cert.display(),
        files.server_key.display()
    );
    outln!(
        "client: {} (key {})",
        files.client_cert.display(),
        files.client_key.display()
    );
    let block = format!(
        "tls {{\n  cert_file: \"{}\"\n  key_file: \"{}\"\n  ca_file: \"{}\"\n  verify: true   # mutual TLS: clients must present a certificate from this CA\n}}\n",
        files.server_cert.display(),
        files.server_key.display(),
        files.ca.display()
    );
    // The server's tls block as a file of its own, for `include` in a server config (its
    // paths are relative to the directory the server runs in, as printed).
    let conf = args.out.join(TLS_CONF);
    std::fs::write(&conf, &block)
        .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", conf.display()))?;
    outln!(
        "nats.conf: include \"{}\", or paste this block:",
        conf.display()
    );
    for line in block.lines() {
        outln!("  {line}");
    }
    Ok(ExitCode::SUCCESS)
}
