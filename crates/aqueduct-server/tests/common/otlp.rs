//! An in-process OTLP/gRPC trace receiver for the tests, and helpers to read its spans.

use std::sync::{Arc, Mutex};

use aqueduct_server::otel::TracingConfig;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
pub use opentelemetry_proto::tonic::common::v1::any_value::Value;
pub use opentelemetry_proto::tonic::trace::v1::Span;

/// OTLP span flags: whether the parent's remoteness is known (bit 8) ...
pub const HAS_IS_REMOTE: u32 = 0x100;
/// ... and, with it, that the parent span is in another process (bit 9).
pub const REMOTE_PARENT_FLAGS: u32 = 0x300;

/// What the receiver got: (service.name, span).
#[derive(Default, Clone)]
pub struct Received(Arc<Mutex<Vec<(String, Span)>>>);

impl Received {
    pub fn spans(&self) -> Vec<(String, Span)> {
        self.0.lock().expect("lock").clone()
    }
    pub fn of_trace(&self, trace_id: &[u8; 16]) -> Vec<Span> {
        self.spans()
            .into_iter()
            .map(|(_, s)| s)
            .filter(|s| s.trace_id == trace_id)
            .collect()
    }
}

#[tonic::async_trait]
impl TraceService for Received {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut got = self.0.lock().expect("lock");
        for rs in request.into_inner().resource_spans {
            let service = rs
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .find(|kv| kv.key == "service.name")
                .and_then(|kv| kv.value.as_ref()?.value.clone())
                .map(|v| match v {
                    Value::StringValue(s) => s,
                    other => format!("{other:?}"),
                })
                .unwrap_or_default();
            for ss in rs.scope_spans {
                got.extend(ss.spans.into_iter().map(|s| (service.clone(), s)));
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

/// An OTLP/gRPC receiver on 127.0.0.1 (port chosen by the system); served until the test ends.
pub async fn receiver() -> (Received, String, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let received = Received::default();
    let service = TraceServiceServer::new(received.clone());
    let task = tokio::spawn(async move {
        let _ = tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener))
            .await;
    });
    (received, format!("http://{addr}"), task)
}

/// The same receiver over TLS, presenting `cert`/`key` (PEM files); with `client_ca` (PEM), it
/// requires a client certificate that chains to it. Its endpoint is `https://127.0.0.1:PORT`.
pub async fn receiver_tls(
    cert: &std::path::Path,
    key: &std::path::Path,
    client_ca: Option<&str>,
) -> (Received, String, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    receiver_tls_on(listener, cert, key, client_ca)
}

/// [`receiver_tls`] on `listener`.
pub fn receiver_tls_on(
    listener: tokio::net::TcpListener,
    cert: &std::path::Path,
    key: &std::path::Path,
    client_ca: Option<&str>,
) -> (Received, String, tokio::task::JoinHandle<()>) {
    use tonic::transport::{Certificate, Identity, ServerTlsConfig};
    let addr = listener.local_addr().expect("addr");
    let mut tls = ServerTlsConfig::new().identity(Identity::from_pem(
        std::fs::read(cert).expect("cert"),
        std::fs::read(key).expect("key"),
    ));
    if let Some(ca) = client_ca {
        tls = tls.client_ca_root(Certificate::from_pem(ca));
    }
    let received = Received::default();
    let service = TraceServiceServer::new(received.clone());
    let mut server = tonic::transport::Server::builder()
        .tls_config(tls)
        .expect("TLS settings");
    let task = tokio::spawn(async move {
        let _ = server
            .add_service(service)
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener))
            .await;
    });
    (received, format!("https://{addr}"), task)
}

pub fn tracing_to(endpoint: &str, ratio: f64) -> TracingConfig {
    TracingConfig {
        otlp_endpoint: endpoint.into(),
        tls: None,
        sample_ratio: ratio,
        service_name: "aqueduct-test".into(),
    }
}

pub fn attr(span: &Span, key: &str) -> Option<Value> {
    span.attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref()?.value.clone())
}

pub fn str_attr(span: &Span, key: &str) -> Option<String> {
    match attr(span, key)? {
        Value::StringValue(s) => Some(s),
        _ => None,
    }
}

pub fn int_attr(span: &Span, key: &str) -> Option<i64> {
    match attr(span, key)? {
        Value::IntValue(i) => Some(i),
        _ => None,
    }
}

pub fn named<'a>(spans: &'a [Span], name: &str) -> Vec<&'a Span> {
    spans.iter().filter(|s| s.name == name).collect()
}
