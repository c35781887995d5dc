// The program of docs/tutorial.md. The tutorial quotes every region between `// ANCHOR: name`
// and `// ANCHOR_END: name`, in order, so its code blocks put together are this program; outside
// the regions there are only comments. tests/tutorial_doc.rs holds the two to each other and
// runs `run` against a broker of its own.
//
// Against a local broker (`cargo run --release --bin aqueduct-broker`):
//     cargo run -p aqueduct-client --example tutorial [ADDR]

// ANCHOR: connect
use aqueduct_client::{Client, ConnectOptions};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // The broker: the first argument, else a broker on this machine with its defaults.
    let addr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "localhost:4242".to_string());
    let client = Client::connect(ConnectOptions::new(addr)).await?;
    run(&client).await?;
    client.close().await?; // flushes what is still being sent (an error if it was not all taken), then closes
    Ok(())
}

/// The tutorial's sections in order. (`pub` only so that the repository's test can call it.)
pub async fn run(client: &Client) -> anyhow::Result<()> {
    subscribe_and_publish(client).await?;
    publish_options(client).await?;
    consumer_group(client).await?;
    slow_subscriber(client).await?;
    errors(client).await?;
    Ok(())
}
// ANCHOR_END: connect

// ANCHOR: subscribe
async fn subscribe_and_publish(client: &Client) -> anyhow::Result<()> {
    use futures_util::StreamExt;
    use std::time::Duration;
    use tokio::time::timeout;

    let mut orders = client.subscribe("orders/+").await?; // returns once the broker confirms
    client.publish("orders/eu", "hello").await?;
    client.publish("orders/us", "world").await?;

    // Read the two messages just published, waiting at most 5 s for each.
    let mut two = orders.by_ref().take(2);
    while let Some(msg) = timeout(Duration::from_secs(5), two.next()).await? {
        let msg = msg?; // broker ERRORs arrive as Err
        let (topic, offset, level) = (msg.topic(), msg.offset(), msg.priority().level());
        println!("{topic} #{offset} p{level}: {:?}", msg.body());
    }
    orders.unsubscribe().await?; // dropping `orders` would unsubscribe too
    Ok(())
}
// ANCHOR_END: subscribe

// ANCHOR: options
async fn publish_options(client: &Client) -> anyhow::Result<()> {
    use aqueduct_client::{Priority, PublishOptions};
    use bytes::Bytes;
    use std::time::Duration;

    let urgent = PublishOptions {
        priority: Some(Priority::HIGHEST), // 0; the default is 2, the lowest 3
        ttl: Some(Duration::from_secs(10)),
        confirm: true,
        ..Default::default() // also `trace`: see docs/howto-tracing.md
    };
    let offset = client.publish_with("alerts", "disk 99%", &urgent).await?; // Some(offset)
    println!("alerts #{}", offset.unwrap_or_default());

    let batch = (0..100).map(|i| ("metrics/cpu", Bytes::from(i.to_string())));
    let confirmed = PublishOptions {
        confirm: true,
        ..Default::default()
    };
    let offsets = client.publish_batch(batch, &confirmed).await?; // Some(one offset each)
    let offsets = offsets.unwrap_or_default();
    if let (Some(first), Some(last)) = (offsets.first(), offsets.last()) {
        println!("metrics/cpu #{first} ..= #{last}");
    }
    Ok(())
}
// ANCHOR_END: options

// ANCHOR: groups
async fn consumer_group(client: &Client) -> anyhow::Result<()> {
    use futures_util::StreamExt;
    use std::time::Duration;
    use tokio::time::timeout;

    let mut worker = client.subscribe_group("jobs", "resizers").await?;
    let mut dead_letters = client.subscribe("__dlq__jobs").await?;
    for job in ["cat.jpg", "dog.png", "notes.txt"] {
        client.publish("jobs", job).await?;
    }

    // Work until no job has come for 2 s (at most 20 deliveries): notes.txt fails every time,
    // so it comes back until its retries are used up, then it goes to the dead letters.
    let mut deliveries = worker.by_ref().take(20);
    while let Ok(Some(job)) = timeout(Duration::from_secs(2), deliveries.next()).await {
        let job = job?;
        match process(job.body()) {
            Ok(()) => job.ack().await?,
            Err(e) => job.nack(Some(&e.to_string())).await?, // redelivered, attempt + 1
        }
    }

    let Some(dead) = timeout(Duration::from_secs(5), dead_letters.next()).await? else {
        anyhow::bail!("the dead-letter subscription ended");
    };
    let dead = dead?;
    let origin = dead.extensions(); // where it came from, and why
    let topic = origin
        .original_topic
        .map(|t| t.to_string())
        .unwrap_or_default();
    let attempts = origin.attempts_made.unwrap_or_default();
    let reason = origin.reason.unwrap_or_default();
    println!(
        "dead letter {:?} from {topic} after {attempts} attempts: {reason}",
        dead.body()
    );
    Ok(())
}

fn process(job: &[u8]) -> anyhow::Result<()> {
    if !(job.ends_with(b".jpg") || job.ends_with(b".png")) {
        anyhow::bail!("not an image");
    }
    println!("resized {}", String::from_utf8_lossy(job));
    Ok(())
}
// ANCHOR_END: groups

// ANCHOR: overflow
async fn slow_subscriber(client: &Client) -> anyhow::Result<()> {
    use aqueduct_client::{OverflowPolicy, SubscribeOptions};
    use futures_util::StreamExt;
    use std::time::Duration;
    use tokio::time::timeout;

    let opts = SubscribeOptions {
        overflow: Some(OverflowPolicy::Block),
        ..Default::default()
    };
    let mut loader = client.subscribe_with("events/#", &opts).await?;

    // Publish more than the broker queues for a subscription, from another task (a clone of
    // `client`: same connection), while this one reads. Block loses none of them.
    let publisher = client.clone();
    let producer = tokio::spawn(async move {
        for i in 0..3000 {
            publisher
                .publish("events/clicks", format!("click {i}"))
                .await?;
        }
        anyhow::Ok(())
    });
    let mut received = 0;
    let mut events = loader.by_ref().take(3000);
    while let Some(event) = timeout(Duration::from_secs(5), events.next()).await? {
        event?;
        received += 1;
    }
    producer.await??;
    println!("events/#: {received} of 3000 received");
    Ok(())
}
// ANCHOR_END: overflow

// ANCHOR: errors
async fn errors(client: &Client) -> anyhow::Result<()> {
    use aqueduct_client::{ClientError, ErrorCode, SubscribeOptions};
    use futures_util::StreamExt;
    use std::time::Duration;
    use tokio::time::timeout;

    // Refused by the client itself, before anything is sent: `#` must be the last level.
    match client.subscribe("orders/#/eu").await {
        Err(ClientError::InvalidName { what, reason }) => println!("invalid {what}: {reason}"),
        other => anyhow::bail!("expected an invalid filter, got {other:?}"),
    }

    // Refused by the broker: settling the same delivery twice.
    let explicit = SubscribeOptions {
        ack: true,
        ..Default::default()
    };
    let mut audit = client.subscribe_with("audit", &explicit).await?;
    client.publish("audit", "login alice").await?;
    let Some(entry) = timeout(Duration::from_secs(5), audit.next()).await? else {
        anyhow::bail!("the subscription ended");
    };
    let entry = entry?;
    entry.ack().await?;
    entry.ack().await?; // sent; the broker's answer comes on the subscription's stream
    match timeout(Duration::from_secs(5), audit.next()).await? {
        Some(Err(ClientError::Broker {
            code: ErrorCode::NOT_IN_FLIGHT,
            reason,
        })) => {
            println!("second ack refused: {reason}")
        }
        other => anyhow::bail!("expected NOT_IN_FLIGHT, got {other:?}"),
    }
    Ok(())
}
// ANCHOR_END: errors
