//! Codec benchmarks: batch decode per sub-frame, single-frame decode, delivery encode.
//! Figures and the exact command are in docs/benchmarks.md.

use std::hint::black_box;

use aqueduct_proto::delivery::{Arena, DeliveryFields};
use aqueduct_proto::*;
use bytes::{Bytes, BytesMut};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};

fn batch_of(n: usize, body: usize) -> PublishBatch {
    let topic = TopicName::try_from("orders/eu/de/42").expect("valid");
    let publishes: Vec<_> = (0..n)
        .map(|_| Publish::new(topic.clone(), Bytes::from(vec![0xAB; body])))
        .collect();
    PublishBatch::from_publishes(&publishes)
}

fn batch_decode(c: &mut Criterion) {
    let batch = batch_of(100, 128);
    let payload = batch.payload().clone();
    let mut g = c.benchmark_group("batch_decode");
    g.throughput(Throughput::Elements(100));
    // Frame boundaries and extension blocks as borrowed slices: what a router needs to walk a batch.
    g.bench_function("walk_100x128B", |b| {
        b.iter(|| {
            let mut n = 0usize;
            for sub in BatchIter::new(black_box(&payload)) {
                match sub {
                    Ok(f) => n += f.payload.len(),
                    Err(_) => return 0,
                }
            }
            n
        })
    });
    // Full decode to owned `Publish` values (topic validated, Bytes::slice of the batch buffer).
    g.bench_function("publishes_100x128B", |b| {
        b.iter(|| {
            black_box(&batch)
                .publishes()
                .filter_map(Result::ok)
                .map(|p| p.body.len())
                .sum::<usize>()
        })
    });
    // Borrowed decode: what the broker routes from (no reference counts, no allocation).
    g.bench_function("refs_100x128B", |b| {
        b.iter(|| {
            black_box(&batch)
                .iter_refs()
                .filter_map(Result::ok)
                .map(|p| p.body.len())
                .sum::<usize>()
        })
    });
    // Validation of a whole received batch (what the broker does before routing any of it).
    g.bench_function("validate_100x128B", |b| {
        b.iter(|| {
            PublishBatch::from_parts(Extensions::default(), black_box(payload.clone()))
                .map(|b| b.len())
        })
    });
    g.finish();
}

fn frame_decode(c: &mut Criterion) {
    let topic = TopicName::try_from("orders/eu/de/42").expect("valid");
    let frame = Frame::new(
        1,
        frame::Message::Publish(
            Publish::new(topic.clone(), Bytes::from(vec![0xAB; 128]))
                .with_priority(Priority::HIGHEST),
        ),
    )
    .to_bytes();
    c.bench_function("frame_decode_publish_128B", |b| {
        b.iter(|| decode_frame(black_box(&frame), &Limits::default()).map(|(_, n)| n))
    });
    let body = [0xABu8; 128];
    let mut arena = Arena::default();
    let mut out = BytesMut::with_capacity(1 << 16);
    c.bench_function("delivery_encode_and_write_128B", |b| {
        b.iter(|| {
            let shared = SharedDelivery::encode(
                &mut arena,
                &DeliveryFields {
                    topic: &topic,
                    offset: 42,
                    priority: Priority::DEFAULT,
                    trace: None,
                    compression: None,
                    dead_letter: None,
                    body: black_box(&body),
                },
            );
            shared.write_frame(&mut out, 7, 1);
            let n = out.len();
            out.clear();
            n
        })
    });
}

criterion_group!(benches, batch_decode, frame_decode);
criterion_main!(benches);
