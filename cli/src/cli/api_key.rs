//! `chorus api-key`: a gateway API key, written to a file of its own, and the
//! `[[gateway.api_keys]]` block that lets it in (the configuration holds only its SHA-256).

use std::path::PathBuf;
use std::process::ExitCode;

use base64::Engine;
use sha2::Digest;

/// The prefix of every key `chorus api-key` makes, so a secret scanner (or a person) knows one
/// when it leaks.
const PREFIX: &str = "chorus_";

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// The gateway identity the key acts as (one of `[[gateway.identities]]`).
    identity: String,
    /// A scope the key carries (a `[[gateway.scopes]]` name; repeat for several). Scopes count
    /// only where the gateway has `[[gateway.scopes]]`; without them a key reaches every route.
    #[arg(long = "scope", value_name = "SCOPE")]
    scopes: Vec<String>,
    /// Directory for the key file `<identity>.key` (written with mode 0600; an existing one is
    /// never overwritten).
    #[arg(long, default_value = ".")]
    out: PathBuf,
}

pub(crate) fn run(args: Args) -> anyhow::Result<ExitCode> {
    chorus_sdk::subject::validate_token("identity", &args.identity)?;
    for scope in &args.scopes {
        if scope.is_empty() || scope.contains(['"', '\\']) || scope.chars().any(char::is_control) {
            anyhow::bail!(
                "--scope {scope:?}: a scope's name is non-empty, without quotes, backslashes or control characters"
            );
        }
    }
    let key = generate()?;
    std::fs::create_dir_all(&args.out)
        .map_err(|e| anyhow::anyhow!("cannot create {}: {e}", args.out.display()))?;
    let path = args.out.join(format!("{}.key", args.identity));
    super::creds::write_secret(&path, &key)?;
    eprintln!(
        "key written to {} (keep it secret; callers send it as `X-API-Key`); append the block \
         below to the coordinator's configuration",
        path.display()
    );
    outln!("{}", block(&args.identity, &key, &args.scopes));
    Ok(ExitCode::SUCCESS)
}

/// A new key: 32 bytes from the operating system's generator, base64url, with [`PREFIX`].
fn generate() -> anyhow::Result<String> {
    use ring::rand::SecureRandom;
    let mut bytes = [0u8; 32];
    ring::rand::SystemRandom::new()
        .fill(&mut bytes)
        .map_err(|_| anyhow::anyhow!("the operating system's random generator failed"))?;
    Ok(format!(
        "{PREFIX}{}",
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
    ))
}

/// The `[[gateway.api_keys]]` block of `key` for `identity`: its SHA-256, never the key.
fn block(identity: &str, key: &str, scopes: &[String]) -> String {
    let sha256 = hex::encode(sha2::Sha256::digest(key.as_bytes()));
    let mut out =
        format!("\n[[gateway.api_keys]]\nidentity = \"{identity}\"\nsha256 = \"{sha256}\"\n");
    if !scopes.is_empty() {
        let quoted: Vec<String> = scopes.iter().map(|s| format!("\"{s}\"")).collect();
        out.push_str(&format!("scopes = [{}]\n", quoted.join(", ")));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_is_new_each_time_prefixed_and_long_enough() {
        let (a, b) = (generate().expect("key"), generate().expect("key"));
        assert_ne!(a, b);
        assert!(a.starts_with(PREFIX) && a.len() == PREFIX.len() + 43, "{a}");
    }

    #[test]
    fn the_block_reads_as_the_gateways_configuration_and_holds_only_the_digest() {
        let key = "chorus_example";
        let text = format!(
            "[gateway]\n[[gateway.identities]]\nid = \"ops\"\n{}",
            block("ops", key, &["operator".into(), "viewer".into()])
        );
        assert!(
            !text.contains(key),
            "the key itself is never printed: {text}"
        );
        #[derive(serde::Deserialize)]
        struct File {
            gateway: chorus_gateway::GatewayConfig,
        }
        let file: File = toml::from_str(&text).expect("the gateway's configuration");
        let keys = &file.gateway.api_keys;
        assert_eq!(keys.len(), 1);
        assert_eq!(keys[0].identity, "ops");
        assert_eq!(
            keys[0].sha256,
            hex::encode(sha2::Sha256::digest(key.as_bytes()))
        );
        assert_eq!(keys[0].scopes, ["operator", "viewer"]);
    }
}
