//! Exporting spans: when `OTEL_EXPORTER_OTLP_ENDPOINT` is set, `chorus serve`, `chorus up` and
//! `chorus demo-agent` install an OTLP/HTTP exporter (binaries built with the `otlp` feature) and
//! turn the SDK's spans on, so the demo agents' and coordinator's traces reach a collector
//! (`chorus up` passes the variable on to the agents its host runs).

use chorus_coordinator::error::{Error, ErrorKind, Result};

/// The variable that switches the exporter on: the collector's base URL.
pub const ENDPOINT_VAR: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";

/// Keeps the exporter alive; flushes it when dropped.
#[derive(Debug)]
pub struct OtelGuard {
    #[cfg(feature = "otlp")]
    provider: opentelemetry_sdk::trace::SdkTracerProvider,
}

impl Drop for OtelGuard {
    fn drop(&mut self) {
        #[cfg(feature = "otlp")]
        {
            let _ = self.provider.shutdown();
        }
    }
}

/// Installs the OTLP exporter if `OTEL_EXPORTER_OTLP_ENDPOINT` asks for one.
pub fn from_env() -> Result<Option<OtelGuard>> {
    let Ok(endpoint) = std::env::var(ENDPOINT_VAR) else {
        return Ok(None);
    };
    install(&endpoint).map(Some)
}

#[cfg(feature = "otlp")]
fn install(endpoint: &str) -> Result<OtelGuard> {
    use opentelemetry_otlp::WithExportConfig;
    // reqwest, under the exporter, has rustls without a provider of its own: ring, as the NATS
    // client uses (already installed is fine).
    let _ = rustls::crypto::ring::default_provider().install_default();
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_endpoint(format!("{}/v1/traces", endpoint.trim_end_matches('/')))
        .build()
        .map_err(Error::wrap(
            ErrorKind::Telemetry,
            format!("cannot export spans to {endpoint}"),
        ))?;
    let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(
            opentelemetry_sdk::Resource::builder()
                .with_service_name("chorus")
                .build(),
        )
        .build();
    opentelemetry::global::set_tracer_provider(provider.clone());
    chorus_sdk::trace::enable_spans();
    tracing::info!(endpoint, "exporting spans over OTLP/HTTP");
    Ok(OtelGuard { provider })
}

#[cfg(not(feature = "otlp"))]
fn install(_endpoint: &str) -> Result<OtelGuard> {
    Err(Error::new(
        ErrorKind::Telemetry,
        "OTEL_EXPORTER_OTLP_ENDPOINT is set but this chorus was built without OTLP; rebuild with `cargo build --release -p chorus-cli --features otlp`",
    ))
}
