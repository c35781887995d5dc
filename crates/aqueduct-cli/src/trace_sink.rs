//! `aqueduct trace-sink`: a minimal OTLP/gRPC trace receiver that prints or counts what it is
//! sent — to see a broker's trace export without installing a collector, and the receiver of
//! the tracing benchmark (scripts/tracebench.py).

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::Context;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::common::v1::KeyValue;
use tokio::sync::Notify;

/// What to do.
#[derive(Debug, Clone)]
pub struct SinkOptions {
    pub listen: String,
    /// Print one line per span.
    pub print: bool,
    /// Stop after this many spans.
    pub spans: Option<u64>,
}

#[derive(Debug, Default)]
struct Counts {
    requests: AtomicU64,
    spans: AtomicU64,
    traces: Mutex<HashSet<Vec<u8>>>,
    print: bool,
    enough: Option<u64>,
    done: Notify,
}

#[derive(Debug, Clone)]
struct Sink(Arc<Counts>);

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn value(kv: &KeyValue) -> String {
    match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::IntValue(i)) => i.to_string(),
        Some(Value::BoolValue(b)) => b.to_string(),
        Some(Value::DoubleValue(d)) => d.to_string(),
        Some(other) => format!("{other:?}"),
        None => String::new(),
    }
}

#[tonic::async_trait]
impl TraceService for Sink {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let c = &self.0;
        c.requests.fetch_add(1, Ordering::Relaxed);
        let mut lines = String::new();
        {
            let mut traces = c.traces.lock().unwrap_or_else(|e| e.into_inner());
            for rs in request.into_inner().resource_spans {
                let service = rs
                    .resource
                    .iter()
                    .flat_map(|r| &r.attributes)
                    .find(|kv| kv.key == "service.name")
                    .map(value)
                    .unwrap_or_default();
                for span in rs.scope_spans.into_iter().flat_map(|s| s.spans) {
                    if c.print {
                        let topic = span
                            .attributes
                            .iter()
                            .find(|kv| kv.key == "messaging.destination.name")
                            .map(value)
                            .unwrap_or_default();
                        lines.push_str(&format!(
                            "{service} {} {topic} trace {} span {} parent {} ({} µs)\n",
                            span.name,
                            hex(&span.trace_id),
                            hex(&span.span_id),
                            hex(&span.parent_span_id),
                            span.end_time_unix_nano
                                .saturating_sub(span.start_time_unix_nano)
                                / 1000
                        ));
                    }
                    traces.insert(span.trace_id);
                    c.spans.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        // Whoever read the output went away (`aqueduct trace-sink | head`): the sink ends, as
        // when it has printed enough.
        let reader_gone =
            !lines.is_empty() && !crate::print_line(lines.trim_end_matches('\n')).unwrap_or(false);
        if reader_gone
            || c.enough
                .is_some_and(|n| c.spans.load(Ordering::Relaxed) >= n)
        {
            c.done.notify_one();
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

/// Receive until SIGTERM, Ctrl-C or `--spans` spans; then print the counts as one JSON line.
pub async fn run(o: &SinkOptions) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(&o.listen)
        .await
        .with_context(|| format!("cannot listen on {}", o.listen))?;
    let addr = listener.local_addr()?;
    crate::print_line(&format!(
        "listening {addr} (OTLP/gRPC: tracing.otlp_endpoint: http://{addr})"
    ))?;
    let sink = Sink(Arc::new(Counts {
        print: o.print,
        enough: o.spans,
        ..Counts::default()
    }));
    let counts = sink.0.clone();
    let stop = async move {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(t) => t,
                Err(_) => return std::future::pending().await,
            };
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
            _ = counts.done.notified() => {}
        }
    };
    tonic::transport::Server::builder()
        .add_service(TraceServiceServer::new(sink.clone()))
        .serve_with_incoming_shutdown(tonic::transport::server::TcpIncoming::from(listener), stop)
        .await
        .context("serving OTLP")?;
    let c = &sink.0;
    let traces = c.traces.lock().unwrap_or_else(|e| e.into_inner()).len();
    crate::print_line(
        &serde_json::json!({
            "requests": c.requests.load(Ordering::Relaxed),
            "spans": c.spans.load(Ordering::Relaxed),
            "traces": traces,
        })
        .to_string(),
    )?;
    Ok(())
}
