//! Browser sessions: a random id in the `chorus_console` cookie names the credential (API key
//! or JWT) given at `POST /login`, checked again on every request (an expired token ends the
//! session), and the session's own CSRF token. Kept in memory, forgotten after
//! `session_idle_secs` unused, at most [`MAX_SESSIONS`] (the least recently used goes first).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The name of the session cookie.
pub(crate) const COOKIE: &str = "chorus_console";
/// The name of the cookie that carries the login form's CSRF token (before any session).
pub(crate) const LOGIN_COOKIE: &str = "chorus_console_login";
/// Sessions kept at once.
pub(crate) const MAX_SESSIONS: usize = 1024;

/// 32 random bytes from the operating system's CSPRNG, as 64 hex digits.
///
/// # Errors
/// When the operating system gives no random bytes.
pub(crate) fn random_hex() -> Result<String, String> {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).map_err(|e| format!("no random bytes: {e}"))?;
    Ok(hex::encode(bytes))
}

/// Whether `a` and `b` are the same, comparing every byte whatever differs.
pub(crate) fn same(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The value of cookie `name` in `headers`' `Cookie` headers.
pub(crate) fn cookie(headers: &axum::http::HeaderMap, name: &str) -> Option<String> {
    headers
        .get_all(axum::http::header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(n, _)| *n == name)
        .map(|(_, v)| v.to_owned())
}

/// One session.
#[derive(Debug, Clone)]
pub(crate) struct Session {
    /// The API key or JWT given at login.
    pub(crate) credential: String,
    /// Its CSRF token.
    pub(crate) csrf: String,
    last_used: Instant,
}

/// The sessions of one console.
#[derive(Debug)]
pub(crate) struct Sessions {
    idle: Duration,
    max: usize,
    map: Mutex<HashMap<String, Session>>,
}

impl Sessions {
    pub(crate) fn new(idle: Duration, max: usize) -> Self {
        Sessions {
            idle,
            max,
            map: Mutex::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Session>> {
        self.map
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A new session for `credential` at `now`: its id and CSRF token.
    ///
    /// # Errors
    /// When no random bytes can be had.
    pub(crate) fn create(
        &self,
        credential: String,
        now: Instant,
    ) -> Result<(String, String), String> {
        let (id, csrf) = (random_hex()?, random_hex()?);
        let mut map = self.lock();
        map.retain(|_, s| now.saturating_duration_since(s.last_used) < self.idle);
        while map.len() >= self.max {
            let Some(oldest) = map
                .iter()
                .min_by_key(|(_, s)| s.last_used)
                .map(|(k, _)| k.clone())
            else {
                break;
            };
            map.remove(&oldest);
        }
        map.insert(
            id.clone(),
            Session {
                credential,
                csrf: csrf.clone(),
                last_used: now,
            },
        );
        Ok((id, csrf))
    }

    /// Session `id` at `now`, its use recorded; `None` when unknown or idle too long (then
    /// forgotten).
    pub(crate) fn get(&self, id: &str, now: Instant) -> Option<Session> {
        let mut map = self.lock();
        let session = map.get_mut(id)?;
        if now.saturating_duration_since(session.last_used) >= self.idle {
            map.remove(id);
            return None;
        }
        session.last_used = now;
        Some(session.clone())
    }

    /// Forgets session `id`.
    pub(crate) fn remove(&self, id: &str) {
        self.lock().remove(id);
    }

    /// Sessions held.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.lock().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_ends_after_its_idle_time_and_use_keeps_it() {
        let sessions = Sessions::new(Duration::from_secs(60), 10);
        let t0 = Instant::now();
        let (id, csrf) = sessions.create("key".into(), t0).expect("random");
        assert_eq!(id.len(), 64);
        assert_ne!(id, csrf);
        let s = sessions
            .get(&id, t0 + Duration::from_secs(50))
            .expect("used within its idle time");
        assert_eq!(
            (s.credential.as_str(), s.csrf.as_str()),
            ("key", csrf.as_str())
        );
        // Used at 50 s: still there at 100 s, gone 60 s after its last use.
        assert!(sessions.get(&id, t0 + Duration::from_secs(100)).is_some());
        assert!(sessions.get(&id, t0 + Duration::from_secs(160)).is_none());
        assert_eq!(sessions.len(), 0);
        assert!(sessions.get("unknown", t0).is_none());
    }

    #[test]
    fn the_number_of_sessions_is_bounded() {
        let sessions = Sessions::new(Duration::from_secs(60), 3);
        let t0 = Instant::now();
        let first = sessions.create("a".into(), t0).expect("random").0;
        for i in 1..5u64 {
            sessions
                .create("b".into(), t0 + Duration::from_secs(i))
                .expect("random");
        }
        assert_eq!(sessions.len(), 3);
        assert!(sessions.get(&first, t0 + Duration::from_secs(5)).is_none());
    }

    #[test]
    fn tokens_compare_whole() {
        assert!(same("abc", "abc"));
        assert!(!same("abc", "abd") && !same("abc", "ab") && !same("", "a"));
    }

    #[test]
    fn cookies_are_read_by_name() {
        let mut h = axum::http::HeaderMap::new();
        h.insert(
            axum::http::header::COOKIE,
            "other=1; chorus_console=abc; x=y".parse().expect("header"),
        );
        assert_eq!(cookie(&h, COOKIE).as_deref(), Some("abc"));
        assert_eq!(cookie(&h, LOGIN_COOKIE), None);
    }
}
