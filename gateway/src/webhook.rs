//! Webhook URLs the gateway may post to: a URL is parsed into its scheme, host, port and path,
//! and allowed only under a configured prefix (same scheme, host and port, a path under it),
//! so a client cannot point the gateway at any other address.

/// A webhook URL, or an allow-list prefix, as its parts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Webhook {
    scheme: String,
    host: String,
    port: u16,
    path: String,
}

impl Webhook {
    pub(crate) fn parse(text: &str) -> Result<(Self, url::Url), String> {
        let url = url::Url::parse(text).map_err(|e| format!("not a URL: {e}"))?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err("the scheme must be http or https".into());
        }
        if !url.username().is_empty() || url.password().is_some() {
            return Err("no user info in a webhook URL".into());
        }
        if url.fragment().is_some() {
            return Err("no fragment in a webhook URL".into());
        }
        let host = url
            .host_str()
            .ok_or_else(|| "a host is needed".to_string())?
            .to_ascii_lowercase();
        let port = url
            .port_or_known_default()
            .ok_or_else(|| "a port is needed".to_string())?;
        Ok((
            Webhook {
                scheme: url.scheme().to_owned(),
                host,
                port,
                path: url.path().to_owned(),
            },
            url,
        ))
    }

    /// An allow-list entry.
    pub(crate) fn prefix(text: &str) -> Result<Self, String> {
        let (prefix, url) = Self::parse(text)?;
        if url.query().is_some() {
            return Err("a prefix has no query".into());
        }
        Ok(prefix)
    }

    /// Whether this URL is under `prefix`: same scheme, host and port, and its path the
    /// prefix's or below it (a prefix path without a trailing slash is a whole segment).
    pub(crate) fn under(&self, prefix: &Webhook) -> bool {
        if (self.scheme.as_str(), self.host.as_str(), self.port)
            != (prefix.scheme.as_str(), prefix.host.as_str(), prefix.port)
        {
            return false;
        }
        let base = prefix.path.as_str();
        self.path == base
            || (base.ends_with('/') && self.path.starts_with(base))
            || self
                .path
                .strip_prefix(base)
                .is_some_and(|rest| rest.starts_with('/'))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hook(url: &str) -> Webhook {
        Webhook::parse(url).expect("a URL").0
    }

    #[test]
    fn a_webhook_must_fall_under_an_allowed_prefix() {
        let prefix = Webhook::prefix("https://hooks.example.com/a2a/").expect("a prefix");
        for ok in [
            "https://hooks.example.com/a2a/",
            "https://hooks.example.com/a2a/task?x=1",
            "https://HOOKS.example.com:443/a2a/deep/path",
        ] {
            assert!(hook(ok).under(&prefix), "{ok}");
        }
        for bad in [
            "http://hooks.example.com/a2a/x",
            "https://hooks.example.com:8443/a2a/x",
            "https://hooks.example.com.evil.test/a2a/x",
            "https://hooks.example.com/a2ab",
            "https://hooks.example.com/",
            "https://169.254.169.254/a2a/",
        ] {
            assert!(!hook(bad).under(&prefix), "{bad}");
        }
        let segment = Webhook::prefix("http://127.0.0.1:9000/hooks").expect("a prefix");
        assert!(hook("http://127.0.0.1:9000/hooks/1").under(&segment));
        assert!(hook("http://127.0.0.1:9000/hooks").under(&segment));
        assert!(!hook("http://127.0.0.1:9000/hooksx").under(&segment));
        for refused in [
            "ftp://x/",
            "https://user:pw@hooks.example.com/a2a/",
            "https://h/a#f",
            "not a url",
        ] {
            assert!(Webhook::parse(refused).is_err(), "{refused}");
        }
    }
}
